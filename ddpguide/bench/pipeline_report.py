"""Reading a pipeline benchmark run: the sweep as rows, stage times, the plot, the source's table.

The inputs are what :func:`ddpguide.bench.pipeline_cases.measure` returns (or a report
saved as JSON, :func:`sweep_from_report`); the outputs are plain rows and numbers, a
matplotlib figure of seconds per step against micro-batch size (median of the timed steps,
bars from the fastest to the slowest), and the source article's GPU figures next to this
machine's.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ddpguide.bench.pipeline_cases import BALANCED

# The source article's figures: ResNet50, 128x128 images, batch 120, two GPUs.
SEED_SECONDS = {"single": 3.75, "model_parallel": 4.02, "pipeline_split20": 2.51, "pipeline_split12": 2.43}


def spread(samples: list[float]) -> dict:
    """The median of the timed steps and the range the error bars show (min to max)."""
    return {"seconds": statistics.median(samples), "low": min(samples), "high": max(samples),
            "steps_timed": len(samples)}


def pipeline_rows(measured: dict) -> list[dict]:
    """The pipeline cases of :func:`.pipeline_cases.measure` as rows (schedule, split_size,
    split_point, and the median, min and max seconds of its timed steps), the balanced split
    resolved and duplicates of the source's cut dropped."""
    rows = {}
    for case, samples in measured["samples"].items():
        if case.kind == "pipeline":
            point = measured["balanced"] if case.split_point == BALANCED else case.split_point
            rows[(case.schedule, case.split_size, point)] = {
                "schedule": case.schedule, "split_size": case.split_size, "split_point": point,
                **spread(samples)}
    return list(rows.values())


def sweep_from_report(report: dict) -> tuple[list[dict], dict, dict, str]:
    """(rows, baselines, baseline ranges, title) of a saved pipeline report, for :func:`plot_sweep`."""
    rows, baselines, ranges, title = [], {}, {}, ""
    for m in report["measurements"]:
        details = m.get("details", {})
        title = details.get("case", title)
        if "split_size" in details:
            rows.append(details)
        elif "kind" in details:
            baselines[details["kind"]] = details.get("seconds", m["value"] / 1e3)
            if "low" in details:
                ranges[details["kind"]] = (details["low"], details["high"])
    return rows, baselines, ranges, title


def plot_saved_sweep(report: dict, ax=None):
    """The split-size chart of a pipeline report saved with ``--json``."""
    rows, baselines, ranges, title = sweep_from_report(report)
    return plot_sweep(rows, baselines, title, ax=ax, baseline_ranges=ranges)


def stage_times(block_times: list[float], cut: int) -> tuple[float, float]:
    """Seconds of the two stages when the second starts at block ``cut``."""
    return sum(block_times[:cut]), sum(block_times[cut:])


def plot_sweep(rows: list[dict], baselines: dict, title: str, path: str | None = None, ax=None,
               baseline_ranges: dict | None = None):
    """Seconds per step against micro-batch size, one line per (schedule, split point),
    with the one-process cases as horizontal lines; saved to ``path`` when given.

    Points are the median step; where a row has ``low`` and ``high`` (the fastest and
    slowest timed step) they are its error bar, and ``baseline_ranges`` (kind -> (low,
    high)) shades the same range around a baseline. Draws on ``ax`` (a new pyplot
    figure by default) and returns the figure."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 4))
    fig = ax.figure
    for key in sorted({(r["schedule"], r["split_point"]) for r in rows}):
        pts = sorted((r["split_size"], r["seconds"], r.get("low", r["seconds"]),
                      r.get("high", r["seconds"]))
                     for r in rows if (r["schedule"], r["split_point"]) == key)
        sizes, medians, lows, highs = zip(*pts)
        errors = [[m - lo for m, lo in zip(medians, lows)], [h - m for m, h in zip(medians, highs)]]
        ax.errorbar(sizes, medians, yerr=errors, fmt="o-", capsize=3,
                    label=f"pipeline {key[0]}, stage 1 from {key[1]}")
    styles = {"single": ("1 process x 1 thread", "k"),
              "model_parallel": ("naive model parallel", "tab:red"),
              "threads2": ("1 process x 2 threads", "tab:gray")}
    for name, (label, color) in styles.items():
        if name in baselines:
            ax.axhline(baselines[name], ls="--", color=color, label=label)
            if baseline_ranges and name in baseline_ranges:
                ax.axhspan(*baseline_ranges[name], color=color, alpha=0.12, lw=0)
    if "single" in baselines:
        ax.axhline(baselines["single"] / 2, ls=":", color="k", label="2 cores, perfectly used")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["split_size"] for r in rows})
    ax.set_xticks(ticks, [str(s) for s in ticks])
    ax.set_xlabel("micro-batch size (split_size)")
    ax.set_ylabel("seconds per training step\n(median; bars: fastest to slowest)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def seed_table(single: float, model_parallel: float, best_seed: dict, best_balanced: dict) -> list[str]:
    """The source's comparison, its GPU seconds next to this machine's milliseconds."""
    s = SEED_SECONDS
    rows = [
        ("one device", f"{s['single']:.2f} s", f"{single * 1e3:.0f} ms (1 process x 1 thread)"),
        ("model parallel", f"{s['model_parallel']:.2f} s ({s['model_parallel'] / s['single']:.2f}x time)",
         f"{model_parallel * 1e3:.0f} ms ({model_parallel / single:.2f}x time)"),
        ("pipelined", f"{s['pipeline_split20']:.2f} s ({s['single'] / s['pipeline_split20']:.2f}x, split 20)",
         f"{best_seed['seconds'] * 1e3:.0f} ms ({single / best_seed['seconds']:.2f}x, source's split, "
         f"micro-batch {best_seed['split_size']})"),
        ("pipelined, best",
         f"{s['pipeline_split12']:.2f} s ({s['single'] / s['pipeline_split12']:.2f}x, split 12)",
         f"{best_balanced['seconds'] * 1e3:.0f} ms ({single / best_balanced['seconds']:.2f}x, stage 1 "
         f"from {best_balanced['split_point']}, micro-batch {best_balanced['split_size']})"),
    ]
    lines = [f"{'':16}  {'source: 2 GPUs, 128x128, batch 120':34}  this machine: CPU processes"]
    lines += [f"{name:16}  {gpu:34}  {cpu}" for name, gpu, cpu in rows]
    return lines
