"""Expert parallelism: throughput on 2 ranks against one process, the bytes of the
all-to-alls against the formula, and a hot expert against a balanced router.

``python -m ddpguide.bench experts [--quick] [--json FILE]``

Every timed case runs the chapter's own layer (``book/programs/moe_expert_parallel.py``,
loaded by path) in fresh processes with 1 thread each (``--quick``: forked warm), in
interleaved rounds:

* ``single``: one process, the whole batch of 2T tokens (in 2 groups), all E experts;
* ``ep2``: 2 ranks, T tokens each, E/2 experts each, tokens exchanged by all-to-all;
* ``hot``: ``ep2`` with expert 0's router bias raised so that (nearly) every token
  chooses it: rank 0 computes every expert output, rank 1 waits for it.

A step is forward, backward, the gradients summed over the ranks, and an SGD update;
k = 1 and dropless (no capacity), so that no token is dropped and the work is the same;
float64, so that the experts run one after another (``torch._grouped_mm`` refuses float64).
The bytes are counted, not timed (:mod:`ddpguide.experts.traffic`).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.core.runtime import CPU_BACKEND
from ddpguide.experts import traffic
from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn

EXPERTS, HIDDEN, FFN = 4, 64, 512


def step_worker(tokens: int, skew: float, warmup: int, steps: int) -> dict:
    """One rank: median seconds of a training step, and the tokens each local expert got."""
    program = programs.load(traffic.PROGRAM)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    local = EXPERTS // ranks
    layer = program.make_layer(HIDDEN, FFN, EXPERTS, 0, skew, rank * local, local)
    generator = torch.Generator().manual_seed(rank)
    per_rank = tokens * 2 // ranks
    x = torch.randn(per_rank, HIDDEN, generator=generator, dtype=torch.float64)
    times, received = [], None
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        if ranks == 1:
            out = program.reference(layer, x, 1, None, 2)  # dropless
        else:
            out = program.expert_parallel(layer, x, 1, None, None, 2 * tokens)
            received = out.received
        (out.y.square().mean() + 0.01 * out.aux).backward()
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if ranks > 1 and not name.startswith("w_"):
                    dist.all_reduce(p.grad)
                p -= 1e-3 * p.grad
                p.grad = None
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"step": statistics.median(times), "received": received}


CASES = {"single": (1, 0.0), "ep2": (2, 0.0), "hot": (2, 20.0)}


def _time(case: str, tokens: int, warmup: int, steps: int, quick: bool = False) -> dict:
    """One case's step; ``quick`` (every figure comes out, none is kept) keeps glibc's own
    allocator settings, so that warm ranks may run it."""
    ranks, skew = CASES[case]
    results = spawn(step_worker, ranks, tokens, skew, warmup, steps, threads_per_rank=1, backend=CPU_BACKEND,
                    env=None if quick else MALLOC_ENV, echo=False, timeout=600)
    return {"step": max(r["step"] for r in results),
            "received": [n for r in results for n in (r["received"] or [])]}


def run(quick: bool = False) -> Report:
    """Measure the cases (see the module docstring) and return the report."""
    from tqdm.auto import tqdm

    tokens = 256 if quick else 2048
    warmup, steps, rounds = (1, 2, 1) if quick else (2, 10, 3)
    report = Report("experts")
    details = {"layer": f"E={EXPERTS} experts Linear({HIDDEN}, {FFN})-ReLU-Linear({FFN}, {HIDDEN}), "
                        f"k=1, float64", "tokens per rank (ep2)": tokens, "threads per rank": 1}

    def say(line: str) -> None:
        print(line, flush=True)

    plan = [("bytes", ranks) for ranks in ((2,) if quick else (2, 4))] + [
        ("time", case) for _ in range(rounds) for case in CASES]
    measured: dict[str, list[float]] = {case: [] for case in CASES}
    received: dict[str, list[int]] = {}
    bytes_ratio = {}
    for kind, what in tqdm(plan, desc="experts", file=sys.stderr, leave=False):
        if kind == "bytes":
            ranks = what
            counted = traffic.count(ranks, tokens=tokens, hidden=HIDDEN, ffn=FFN,
                                    experts=EXPERTS)
            sent = max(r["counts_bytes"] + r["token_bytes"] for r in counted)
            formula = counted[0]["formula"]
            bytes_ratio[ranks] = sent / formula
            report.add(f"all-to-all bytes per rank, forward, {ranks} ranks", sent, "B",
                       formula=formula, counts_bytes=counted[0]["counts_bytes"],
                       backward_bytes=max(r["backward_bytes"] for r in counted), **details)
            say(f"all-to-all bytes per rank, {ranks} ranks: {sent:.0f} B counted, "
                f"{formula:.0f} B by the formula: {bytes_ratio[ranks]:.5f}")
        else:
            result = _time(what, tokens, warmup, steps, quick)
            measured[what].append(result["step"])
            received[what] = result["received"]
            say(f"{what}: step {result['step'] * 1e3:.1f} ms")
    ratio_tokens, ratio_hot = [], []
    for single, ep2, hot in zip(measured["single"], measured["ep2"], measured["hot"]):
        ratio_tokens.append(single / ep2)  # the same 2T tokens per step on both sides
        ratio_hot.append(hot / ep2)
    labels = {"single": "1 process, 2T tokens", "ep2": "EP 2 ranks, T tokens each",
              "hot": "EP 2 ranks, one hot expert"}
    for case, values in measured.items():
        report.add(f"{labels[case]}: step", statistics.median(values) * 1e3, "ms",
                   tokens_per_expert=received.get(case), **details)
    report.ratios["alltoall_bytes_over_formula"] = bytes_ratio[2]
    report.add_ratio("ep2_tokens_per_s_over_single", ratio_tokens)
    report.add_ratio("hot_expert_step_over_balanced", ratio_hot)
    say(f"ep2_tokens_per_s_over_single: {report.ratios['ep2_tokens_per_s_over_single']:.3f}")
    say(f"hot_expert_step_over_balanced: {report.ratios['hot_expert_step_over_balanced']:.3f}")
    report.notes.append(
        "bytes: dispatch + combine of a balanced router send T x hidden x 8 B x 2 x (N-1)/N per "
        "rank; the counts exchange adds (N-1) x E/N x 8 B"
        + (f"; at 4 ranks the ratio is {bytes_ratio[4]:.5f}" if 4 in bytes_ratio else "")
        + ". The backward pass moves the same token bytes again")
    report.notes.append(
        "ep2 vs single: 2 ranks on 2 cores can at most double the tokens per second; the "
        "all-to-alls, the router's gradient all-reduce and the cores' sharing take from it")
    report.notes.append(
        "hot: every token chooses expert 0 on rank 0, which computes all expert outputs while "
        "rank 1 waits in the combine; the expert work per step is the same as balanced")
    return report
