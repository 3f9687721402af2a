"""Helpers of the measurements appendix: the saved results of full benchmark runs
(``make bench`` writes ``book/measurements/<suite>.json``), each ratio set beside
its anchor, with when, where and how it was measured."""

import html
import json
import os
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path


@dataclass(frozen=True)
class Anchor:
    """What a ratio is compared with: a source's figure or the book's goal on a CPU."""

    meaning: str
    reference: str
    goal: str = ""


ANCHORS: dict[str, dict[str, Anchor]] = {
    "allreduce": {
        "ring_over_gloo_64mb": Anchor("hand-written / gloo time, 64 MB, 2 ranks",
                                      "0.95 (plain ring, measured before)", "<= 1.0"),
        "ring_over_gloo_64mb_4ranks": Anchor("hand-written / gloo time, 64 MB, 4 ranks", "0.89 (plain ring)", "<= 1.0"),
        "ring_over_gloo_1mb_4ranks": Anchor("hand-written / gloo time, 1 MB, 4 ranks", "1.74 (plain ring)", "<= 1.3"),
        "plain_ring_over_gloo_64mb": Anchor("one-message-per-step ring / gloo, 64 MB, 2 ranks", "0.95", ""),
        "plain_ring_over_gloo_64mb_4ranks": Anchor("one-message-per-step ring / gloo, 64 MB, 4 ranks", "0.89", ""),
        "plain_ring_over_gloo_1mb_4ranks": Anchor("one-message-per-step ring / gloo, 1 MB, 4 ranks", "1.74", ""),
    },
    "ddp": {
        "ddp2_over_plain": Anchor("DDP 2 ranks x 1 thread / plain loop 1 x 1, throughput, interleaved (headline)",
                                  "1.70, 1.63 (separate processes, before)", ">= 0.97 x independent2_speedup"),
        "independent2_speedup": Anchor("2 independent plain processes / 1, throughput, interleaved",
                                       "1.70, 1.71 (2.0 if the cores shared nothing)", ""),
        "ddp2_over_independent2": Anchor("ddp2_over_plain / independent2_speedup", "", ">= 0.97"),
        "ddp1_over_plain": Anchor("DDP 1 rank / plain loop, time, interleaved step by step in one process",
                                  "1.02-1.07 (interleaved, measured before)", "<= 1.03"),
        "ddp1_over_plain_cpu": Anchor("the same, CPU time of the process", "", "<= 1.03"),
        "ddp1_over_plain_no_buffer_sync": Anchor("DDP forward_sync_buffers=False / plain, time", "", ""),
        "ddp1_over_plain_bucket_view": Anchor("DDP gradient_as_bucket_view=True / plain, time", "", ""),
        "ddp1_over_plain_static_graph": Anchor("DDP static_graph=True / plain, time", "", ""),
        "ddp1_over_plain_batched_copy": Anchor("DDP batched_grad_copy=True / plain, time", "", ""),
        "ddp1_over_plain_all_flags": Anchor("DDP with all four options / plain, time",
                                            "0.93-1.03 (two of the options, before)", ""),
        "ddp2_speedup": Anchor("2 ranks / DDP on 1 rank, throughput, ConvNet, interleaved",
                               "1.70-1.78 at batch 256", ""),
        "ddp2_over_plain_separate": Anchor("ddp2_over_plain, each case in its own processes",
                                           "1.70, 1.63 (measured before)", ""),
        "independent2_speedup_separate": Anchor("independent2_speedup, each case in its own processes",
                                                "1.70, 1.71 (measured before)", ""),
        "ddp1_over_plain_separate": Anchor("ddp1_over_plain, each case in its own process",
                                           "1.122, 1.140 (measured before)", ""),
        "threads2_speedup": Anchor("1 process x 2 threads / 1 thread", "", ""),
        "ddp2_speedup_toy": Anchor("2 ranks / 1 rank, throughput, toy model",
                                   "0.74 on 2 GPUs for a small CNN (22.72 s vs 30.82 s)", "< 1: overhead wins"),
    },
    "elastic": {
        "join_s": Anchor("a node joins: s to first resumed step", "8.4 s (tuned, before)", "<= 6 s"),
        "node_loss_s": Anchor("a node leaves: s to first resumed step", "7.5 s (tuned, before)", "<= 6 s"),
        "worker_crash_s": Anchor("a worker is killed: s to first resumed step", "5.1 s (tuned, before)", "<= 4 s"),
        "torchrun_join_s": Anchor("join, torchrun defaults", "8.4 s", ""),
        "torchrun_node_loss_s": Anchor("node loss, torchrun defaults", "44.4 s", ""),
        "torchrun_worker_crash_s": Anchor("worker kill, torchrun defaults", "32.2 s", ""),
    },
    "pipeline": {
        "pipeline_speedup": Anchor("2-stage pipeline / 1 process, source's split",
                                   "1.49x, 1.54x at split 12 (2 GPUs)", ">= 1.6"),
        "pipeline_speedup_balanced": Anchor("pipeline with balanced stages / 1 process", "", "> pipeline_speedup"),
        "model_parallel_over_single": Anchor("naive model parallel / 1 device, time",
                                             "1.07 (4.02 s vs 3.75 s, GPUs)", "~1.0 on CPU"),
        "bubble_efficiency": Anchor("pipeline speed-up / 2 (work per core); can pass bubble_bound", "", ""),
        "stage_work_efficiency": Anchor("m (s0 + s1) / (2 x step): micro-batches' work / core", "", "<= bubble_bound"),
        "bubble_bound": Anchor("m/(m+p-1) for the best run at the source's split", "", ""),
        "stage_balance_bound": Anchor("(s0+s1) / (2 max(s0, s1)) at the source's split", "", ""),
        "threads2_speedup": Anchor("1 process x 2 threads / 1 thread", "1.81 (128x128)", ""),
    },
    "pipeline_schedules": {
        "interleaved_over_1f1b": Anchor("1F1B / Interleaved1F1B step time (throughput), 2 ranks, v=2",
                                        "1.28 (torchtitan, 405B, 1F1B 100 vs interleaved 128 tok/s/GPU)",
                                        "> 1 where the bubble dominates"),
        "zb_bubble_over_1f1b_bubble": Anchor("InterleavedZeroBubble / 1F1B idle time, measured",
                                             "1/6 counted from the action lists (F = I = W)", "<= 0.6"),
        "zbv_bubble_over_1f1b_bubble": Anchor("ZBVZeroBubble / 1F1B idle time, measured", "1/6 counted", "<= 0.6"),
        **{f"bubble_measured_over_formula_{s}": Anchor(f"{s}: idle/busy measured / formula", "", "0.8-1.25")
           for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                     "ZBVZeroBubble", "DualPipeV")},
        "quiet_step_share": Anchor("timed steps with other processes at most 2 % of each rank's core", "", ">= 0.5"),
    },
    "amp": {
        "bf16_over_fp32_time": Anchor("bf16 autocast / fp32 step time", "0.70 (CPU, measured before)", "< 1"),
        "bf16_over_fp32_memory": Anchor("bf16 / fp32 activation memory", "", "< 1"),
        "fp16_over_fp32_time": Anchor("fp16 autocast / fp32 step time (GPU)", "", "< 1"),
    },
    "sharding": {
        "fsdp_state_over_ddp_4ranks": Anchor("FSDP2 / DDP state bytes per rank, 4 ranks",
                                             "0.25 (ZeRO-3: 16/N bytes per parameter)", "<= 0.26"),
        "fsdp_peak_over_ddp_4ranks": Anchor("FSDP2 / DDP peak memory of one step, 4 ranks", "", "<= 0.40"),
        "zero1_state_over_ddp_4ranks": Anchor("ZeRO-1 / DDP state bytes per rank, 4 ranks",
                                              "(4 + 4 + 8/N) / 16 = 0.625", ""),
        "fsdp_step_over_ddp_2ranks": Anchor("FSDP2 / DDP step time, 2 ranks", "1.5 x DDP's bytes moved", ""),
        "hand_zero3_over_fsdp_2ranks": Anchor("ZeRO-3 by hand / FSDP2 step time, 2 ranks", "", "<= 1.2"),
    },
    "context": {
        "ring_over_full_time_2ranks": Anchor(
            "ring attention on 2 ranks / full attention in 1 process, forward + backward time", "", ""),
        "ring_peak_over_full_2ranks": Anchor(
            "ring attention per rank / full attention, peak activation bytes, 2 ranks",
            "(S/N)^2 / S^2 = 0.25 for the scores", "<= 0.55"),
        "zigzag_busiest_over_mean": Anchor("head-tail split: busiest rank / mean, each rank's own CPU time in "
                                           "its block products, causal, 2 ranks on a core each", "1", "<= 1.05"),
        "zigzag_step_busiest_over_mean": Anchor("the same, CPU time of the whole forward and backward", "1", "<= 1.05"),
        "contiguous_busiest_over_mean": Anchor(
            "contiguous split: the same as zigzag_busiest_over_mean",
            "(2N-1)/N = 1.5 counted at N = 2; 2N/(N+1) = 4/3 with whole diagonal blocks", "> 1.05"),
        "contiguous_step_busiest_over_mean": Anchor("contiguous split, the whole forward and backward", "", "> 1.05"),
        "ulysses_bytes_over_ring_bytes": Anchor(
            "bytes sent per rank, Ulysses / ring, forward + backward, 4 ranks", "8(N-1)/N / (6N-4) = 0.3", "= 0.3"),
    },
    "experts": {
        "ep2_tokens_per_s_over_single": Anchor("EP 2 ranks / 1 process, tokens per second, same batch",
                                               "2.0 if the all-to-alls were free (2 cores)", ""),
        "alltoall_bytes_over_formula": Anchor("counted all-to-all bytes per rank / T x h x B x 2(N-1)/N, "
                                              "balanced router, 2 ranks", "1.00 (counts exchange: +16 B)",
                                              "1.00 +- 0.01"),
        "hot_expert_step_over_balanced": Anchor("step time, one hot expert / balanced router, EP 2 ranks",
                                                "up to 2 (rank 0 does all the expert work)", ""),
    },
    "gpt": {
        "mfu_one_process": Anchor("model FLOPs (6 x parameters x tokens + attention) per second / the "
                                  "matmul peak measured in the same run, 1 process, float32", "", ">= 0.5"),
        "bytes_counted_over_predicted": Anchor("bytes put into every collective, counted in a step / "
                                               "the formulas of cost_model.py, every kind and layout", "", "= 1.000"),
        **{f"step_time_predicted_over_measured_{key}": Anchor(
            f"step time predicted (the step at --dim 16 + the growth of FLOPs and bytes) / measured, {name}",
            "", "0.8-1.25")
           for key, name in (("fsdp2_2", "FSDP2 2"), ("tp_2", "TP 2"), ("pp_2", "PP 2"),
                             ("ddp_2", "DDP 2"), ("cp_2", "CP 2"),
                             ("fsdp_x_tp_2_x_2", "FSDP x TP 2 x 2"),
                             ("pp_x_fsdp_2_x_2", "PP x FSDP 2 x 2"))},
        "activation_checkpoint_peak_over_plain": Anchor(
            "growth of peak resident memory in training, --checkpoint-activations / plain, 1 process",
            "a checkpointed block keeps only its input (Ultra-Scale Playbook)", ""),
        "compile_step_over_eager": Anchor("step time, --compile (every block) / eager, 1 process", "", ""),
    },
}
ANCHORS["pipeline"].update(ANCHORS["pipeline_schedules"])  # the pipeline suite runs them too
for _suite, _module in (("cluster", "cluster"), ("plan", "plan_anchors"), ("failures", "failures"),
                       ("diloco", "diloco"), ("slurm", "slurm")):
    ANCHORS[_suite] = {n: Anchor(*t) for n, t in import_module(f"ddpguide.bench.{_module}").ANCHORS.items()}


def machine_summary() -> str:
    """One paragraph on the machine these figures come from."""
    from ddpguide.bench.report import machine_info

    info = machine_info()
    gpus = ", ".join(info["gpus"]) or "none"
    return (f"{info.get('cpu_model', info['processor'])}, {info['cpu_count']} cores; GPUs: {gpus}; "
            f"torch {info['torch']}, Python {info['python']}")


#: Where ``make bench`` keeps the results the appendix shows (relative to book/).
MEASUREMENTS = Path(__file__).resolve().parents[2] / "book" / "measurements"


def load_results(directory: str | os.PathLike = MEASUREMENTS,
                 suites: tuple[str, ...] = ()) -> dict[str, dict | None]:
    """Each suite's saved report, or None where the suite has not been measured yet."""
    from ddpguide.bench import SUITES

    directory = Path(directory)
    results: dict[str, dict | None] = {}
    for name in suites or tuple(SUITES):
        path = directory / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    return results


def provenance(report: dict | None, suite: str = "") -> str:
    """One line: when, on what and with which command a saved report was measured."""
    if report is None:
        return (f"Not measured yet: run `python -m ddpguide.bench {suite} --json "
                f"book/measurements/{suite}.json` (or `make bench`).")
    machine = report.get("machine", {})
    cpu = machine.get("cpu_model", machine.get("processor", "?"))
    gpus = ", ".join(machine.get("gpus", [])) or "no GPU"
    load = report.get("load_at_start")
    load_text = "" if load is None else (
        f"; load average {load:.2f} at the start, {report.get('load_at_end', float('nan')):.2f} "
        "at the end")
    return (f"Measured {report.get('measured_at', '(date not recorded)')} on {cpu}, "
            f"{machine.get('cpu_count', '?')} cores, {gpus}, torch {machine.get('torch', '?')}, "
            f"with {shown_command(report)}{load_text}.")


def shown_command(report: dict) -> str:
    """The saved run's command; a ``--json`` file written elsewhere (a temporary folder) is
    shown as FILE, with where the book keeps it."""
    words = report.get("command", f"python -m ddpguide.bench {report['suite']}").split()
    kept = f"book/measurements/{report['suite']}.json"
    if "--json" not in words[:-1] or words[words.index("--json") + 1] == kept:
        return f"`{' '.join(words)}`"
    words[words.index("--json") + 1] = "FILE"
    return f"`{' '.join(words)}` (FILE then kept as `{kept}`)"


def ratio_rows(report: dict) -> list[tuple[str, float, Anchor]]:
    """(name, value, anchor) for every ratio of a suite's report."""
    anchors = ANCHORS.get(report["suite"], {})  # "kind: *" anchors every "kind: case" ratio
    return [(name, value, anchors.get(name) or anchors.get(name.split(": ")[0] + ": *", Anchor(name, "", "")))
            for name, value in report["ratios"].items()]


def spread_text(report: dict, name: str) -> str:
    """A ratio's spread over rounds as the table shows it ("" for a ratio measured once)."""
    spread = report.get("spreads", {}).get(name)
    if not spread or spread["n"] < 2:
        return ""
    return (f"IQR {spread['q1']:.3f}-{spread['q3']:.3f}, range {spread['min']:.3f}-"
            f"{spread['max']:.3f} ({spread['n']} rounds)")


MAX_MEASUREMENT_ROWS = 16


def ratio_table(report: dict):
    """HTML tables: the suite's ratios beside their anchors, then its measurements.

    A ratio measured over rounds shows its spread (interquartile range and range).
    A suite with many measurements (the all-reduce sweep) shows only its ratios
    here; its table printed by ``python -m ddpguide.bench`` has every size.
    """
    from IPython.display import HTML

    def row(cells, tag="td"):
        return "<tr>" + "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells) + "</tr>"

    style = '<div style="overflow-x:auto; font-size:0.85em">'
    spreads = any(spread_text(report, name) for name in report["ratios"])
    head = ["ratio", "this machine", *(["spread"] if spreads else []), "meaning", "anchor", "goal"]
    parts = [style, "<table>", row(head, "th")]
    for name, value, anchor in ratio_rows(report):
        spread = [spread_text(report, name)] if spreads else []
        parts.append(row([name, f"{value:.3f}", *spread, anchor.meaning, anchor.reference, anchor.goal]))
    parts.append("</table></div>")
    measurements = report["measurements"]
    if len(measurements) <= MAX_MEASUREMENT_ROWS:
        parts += [style, "<table>", row(["measurement", "value", "unit"], "th")]
        parts += [row([m["name"], f"{m['value']:.4g}", m["unit"]]) for m in measurements]
        parts.append("</table></div>")
    else:
        parts.append(f"<p>{len(measurements)} measurements; <code>python -m ddpguide.bench "
                     f"{html.escape(report['suite'])}</code> prints them all.</p>")
    return HTML("".join(parts))


def pipeline_sweep(report: dict | None):
    """The split-size chart of a saved pipeline run (median step time, bars from the
    fastest to the slowest step); says so instead when there is none to draw."""
    if report is None or not any("split_size" in m.get("details", {}) for m in report["measurements"]):
        print("No saved split-size sweep to draw.")
        return None
    import matplotlib.pyplot as plt

    from ddpguide.bench.pipeline_report import plot_saved_sweep

    fig = plot_saved_sweep(report)
    plt.show()
    return fig
