"""Benchmarks: ``python -m ddpguide.bench SUITE [--quick] [--json FILE]``.

Each suite measures its cases side by side in one run and reports ratios, so
that a noisy machine affects both sides of a comparison alike. A suite is a
module ``ddpguide.bench.<name>`` with a function ``run(quick: bool) -> Report``.
"""

from ddpguide.bench.report import Measurement, Report, machine_info

SUITES = {
    "ddp": "DDP overhead and scaling (chapter 1)",
    "allreduce": "hand-written ring all-reduce vs gloo (chapter 2)",
    "elastic": "elastic recovery times (chapter 4)",
    "pipeline": "model and pipeline parallelism (chapter 5)",
    "pipeline_schedules": "every pipelining schedule on 2 ranks, a core each: bubbles, step time (chapter 13)",
    "amp": "mixed precision step time and memory (chapter 7)",
    "sharding": "ZeRO-1, FSDP2 and ZeRO-3 by hand against DDP: memory and step time (chapter 8)",
    "compile": "torch.compile over DDP against eager DDP: step time (chapter 1)",
    "context": "ring attention against full attention: time, memory, balance, bytes (chapter 11)",
    "experts": "expert parallelism: all-to-all bytes, throughput and a hot expert (chapter 12)",
    "gpt": "the GPT on several layouts: bytes counted against predicted, MFU, step time predicted "
           "from a narrow model's step and the growth of compute and bytes, activation checkpointing, "
           "compile (chapter 14)",
    "cluster": "two nodes in network namespaces joined by a rate-limited link: alpha-beta, bytes "
               "on the link against the formulas, hierarchical against flat, DDP overlap (chapter 15)",
    "plan": "the layout planner's memory and step time predicted from microbenchmarks against measured "
            "runs of every layout, rank correlation, and against published GPU runs (chapter 16)",
    "failures": "per-step fault tolerance against torchrun's restart, DiLoCo's bytes and its step "
                "time on a slow link, the checkpoint interval against Young-Daly (chapter 17)",
    "diloco": "DiLoCo against DDP at equal samples on the digits: held-out loss for each H (chapter 17)",
    "slurm": "Slurm on the emulated cluster: a lost node's job requeued, the time to training "
             "resumed against its prediction from SlurmdTimeout and a preempted job (chapter 18)",
}

__all__ = ["Measurement", "Report", "SUITES", "machine_info"]
