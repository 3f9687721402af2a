"""The demo's timeline as a figure: world size and finished epochs over time."""

from __future__ import annotations

from typing import Any

CAUSE_COLORS = {"join": "tab:green", "leave": "tab:orange", "crash": "tab:red"}


def plot_timeline(report: dict[str, Any], ax=None):
    """Two panels: world size over time (training paused while recovering), epochs over time.

    Each disturbance is a vertical line; the shaded span after it lasts until
    the new worker group's first step, labelled with that recovery time.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True,
                               gridspec_kw={"height_ratios": [1, 1.4]})
    else:
        fig = ax[0].figure
    top, bottom = ax
    events = report["events"]
    end = report["duration_s"]

    # World size: 0 until a group takes its first step, and while recovering.
    steps: list[tuple[float, int]] = [(0.0, 0)]
    for e in events:
        if e["event"] in CAUSE_COLORS:
            steps.append((e["time_s"], 0))
        elif e["event"] == "first_step":
            steps.append((e["time_s"], e["world_size"]))
        elif e["event"] == "finished":
            steps.append((e["time_s"], 0))
    steps.append((end, 0))
    times, sizes = zip(*steps)
    top.step(times, sizes, where="post", color="tab:blue", lw=2)
    top.set_ylabel("world size\n(training)")
    top.set_yticks([0, 2, 4])

    for r, e in zip(report["recoveries"], [e for e in events if e["event"] in CAUSE_COLORS]):
        color = CAUSE_COLORS[r["cause"]]
        for axis in (top, bottom):
            axis.axvline(e["time_s"], color=color, ls="--", lw=1)
            axis.axvspan(e["time_s"], e["time_s"] + r["seconds"], color=color, alpha=0.15)
        top.annotate(f"{r['cause']}\n{r['seconds']:.1f} s", (e["time_s"], 4.2),
                     color=color, fontsize=9, va="bottom")
    top.set_ylim(0, 5.6)

    for world_size, marker in ((2, "o"), (4, "s")):
        done = [(e["time_s"], e["epoch"]) for e in report["epochs"]
                if e["world_size"] == world_size and e["time_s"] is not None]
        if done:
            bottom.scatter(*zip(*done), marker=marker, label=f"epoch finished, world size {world_size}")
    for g in report["groups"]:
        bottom.annotate(f"start {g['start_epoch']}\nrestart {g['restart']}",
                        (g["time_s"], g["start_epoch"]), xytext=(3, -26),
                        textcoords="offset points", fontsize=8, ha="left")
    bottom.set_ylim(-3, max([e["epoch"] for e in report["epochs"]], default=0) + 1.5)
    bottom.set_xlabel("seconds since node A started")
    bottom.set_ylabel("epoch")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig
