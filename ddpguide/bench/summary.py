"""The appendix's summary figure: every saved suite's ratios at a glance, one bar each."""

from __future__ import annotations

import statistics


def summary_bars(suite: str, report: dict) -> list[tuple[str, str, float, float, float]]:
    """(ratio or family name, label, value, below, above) per bar of the summary figure: a ratio
    measured over rounds has a line from its smallest to its largest value; a family of per-case
    ratios ("kind: case", the planner's per layout) is one bar, the median of its cases, its line
    their range."""
    families: dict[str, list[str]] = {}
    for name in report["ratios"]:
        families.setdefault(name.split(": ")[0], []).append(name)
    bars = []
    for family, names in families.items():
        values = [report["ratios"][name] for name in names]
        if names == [family]:
            spread = report.get("spreads", {}).get(family) or {"min": values[0], "max": values[0]}
            bars.append((family, f"{suite}: {family}", values[0], values[0] - spread["min"],
                         spread["max"] - values[0]))
        else:
            middle = statistics.median(values)
            bars.append((family, f"{suite}: {family} (median of {len(names)} cases)", middle, middle - min(values),
                         max(values) - middle))
    return bars


def summary_figure(results: dict[str, dict]):
    """The bars of :func:`summary_bars` for every suite, grouped by suite, the ratios above and
    the seconds-valued ones below on their own axis, each bar a fixed height on a figure no wider
    than a page; returns the figure."""
    import matplotlib.pyplot as plt

    every = [bar for suite, r in results.items() for bar in summary_bars(suite, r)]
    unitless = [bar[1:] for bar in every if not bar[0].endswith("_s")]
    seconds = [bar[1:] for bar in every if bar[0].endswith("_s")]
    heights = [max(len(unitless), 1), max(len(seconds), 1)]
    fig, axes = plt.subplots(2, 1, figsize=(8, 0.2 * sum(heights) + 2),
                             gridspec_kw={"height_ratios": heights})
    for ax, rows, label in ((axes[0], unitless, "ratio"), (axes[1], seconds, "seconds")):
        if not rows:
            ax.set_visible(False)
            continue
        names, values, below, above = zip(*rows)
        ax.barh(range(len(values)), values, xerr=[below, above], color="tab:blue",
                error_kw={"ecolor": "black", "lw": 1, "capsize": 2})
        ax.set_yticks(range(len(values)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        if label == "ratio":
            ax.axvline(1.0, color="grey", lw=1, ls="--")
    fig.tight_layout()
    plt.show()
    return fig
