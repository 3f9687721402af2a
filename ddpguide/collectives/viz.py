"""Figures for collectives: one row of coloured blocks per rank.

Everything drawn here comes from tensors that the ranks actually held and
returned; nothing is recomputed for the picture.
"""

from __future__ import annotations

from typing import Callable, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import NullFormatter, ScalarFormatter
from matplotlib.typing import ColorType

from ddpguide.collectives.algorithms import ring_steps

ColorFn = Callable[[float], ColorType]
MIXED = "0.82"  # a value that combines several ranks


def origin_colors(world: int) -> ColorFn:
    """Colour ``10 r + i`` by its rank ``r``; anything else (a sum) in grey."""
    palette = plt.get_cmap("tab10")

    def color(value: float) -> ColorType:
        rank, index = divmod(value, 10)
        if value == int(value) and 0 <= rank < world and index < world:
            return palette(int(rank))
        return MIXED

    return color


def contributor_colors(world: int) -> ColorFn:
    """Colour a sum of ``10**r`` terms by how many ranks it already contains."""
    shades = plt.get_cmap("Blues")

    def color(value: float) -> ColorType:
        count = str(int(value)).count("1")
        return shades(0.15 + 0.75 * count / world)

    return color


def draw_rank_rows(ax: Axes, tensors: Sequence[torch.Tensor], x0: float = 0.0,
                   color: ColorFn | None = None, highlight: Sequence[range] = (),
                   fmt: str = "{:g}") -> None:
    """Draw ``tensors[r]`` as row ``r``: one square per element, its value written on it.

    ``highlight[r]`` (optional) is a range of element indices of row ``r`` to outline.
    """
    color = color or origin_colors(len(tensors))
    for rank, tensor in enumerate(tensors):
        y = -rank
        values = tensor.reshape(-1).tolist()
        if not values:
            ax.text(x0 + 0.45, y + 0.45, "-", ha="center", va="center", color="0.5")
        marked = highlight[rank] if rank < len(highlight) else range(0)
        for j, value in enumerate(values):
            edge = ("black", 2.5) if j in marked else ("white", 1.0)
            face = color(value)
            ax.add_patch(Rectangle((x0 + j, y), 0.92, 0.92, facecolor=face,
                                   edgecolor=edge[0], linewidth=edge[1]))
            ax.text(x0 + j + 0.46, y + 0.46, fmt.format(value), ha="center", va="center",
                    fontsize=8, color=_text_color(face))


def _text_color(face: ColorType) -> str:
    red, green, blue, _ = to_rgba(face)
    return "white" if 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 else "black"


def _frame(ax: Axes, width: float, ranks: int, title: str, rank_labels: bool = True) -> None:
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-ranks + 0.8, 1.3)
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([-r + 0.46 for r in range(ranks)] if rank_labels else [])
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)] if rank_labels else [])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_aspect("equal")


def draw_before_after(ax: Axes, name: str, before: Sequence[torch.Tensor],
                      after: Sequence[torch.Tensor], color: ColorFn | None = None) -> None:
    """One primitive: every rank's tensor before (left) and after (right)."""
    left = max(1, max(t.numel() for t in before))
    right = max(1, max(t.numel() for t in after))
    gap = 1.6
    draw_rank_rows(ax, before, 0, color)
    draw_rank_rows(ax, after, left + gap, color)
    middle = -(len(before) - 1) / 2 + 0.46
    ax.add_patch(FancyArrowPatch((left + 0.15, middle), (left + gap - 0.25, middle),
                                 arrowstyle="-|>", mutation_scale=14, color="0.3"))
    ax.text(left / 2, 1.05, "before", ha="center", fontsize=8, color="0.3")
    ax.text(left + gap + right / 2, 1.05, "after", ha="center", fontsize=8, color="0.3")
    _frame(ax, left + gap + right, len(before), name)


def draw_barrier(ax: Axes, times: Sequence[tuple[float, float]]) -> None:
    """Each rank's arrival at the barrier and its departure, in milliseconds."""
    start = min(a for a, _ in times)
    for rank, (arrival, departure) in enumerate(times):
        ax.barh(-rank, (arrival - start) * 1e3, color=plt.get_cmap("tab10")(rank), height=0.6)
        ax.barh(-rank, (departure - arrival) * 1e3, left=(arrival - start) * 1e3,
                color="white", edgecolor="0.3", hatch="///", height=0.6)
    ax.set_yticks([-r for r in range(len(times))], [f"rank {r}" for r in range(len(times))])
    ax.set_xlabel("ms (coloured: working, hatched: waiting in the barrier)", fontsize=8)
    ax.set_title("barrier", fontsize=10)


def plot_primitives(per_rank: Sequence[dict], columns: int = 2) -> Figure:
    """A figure with every primitive of :func:`ddpguide.collectives.demos.primitives_demo`.

    ``per_rank[r]`` is what rank ``r`` returned.
    """
    names = list(per_rank[0])
    world = len(per_rank)
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 1.0 + 0.55 * world * rows))
    color = origin_colors(world)
    for ax, name in zip(axes.flat, names):
        if name == "barrier":
            draw_barrier(ax, [r[name] for r in per_rank])
        else:
            draw_before_after(ax, name, [r[name][0] for r in per_rank],
                              [r[name][1] for r in per_rank], color)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _ring_panel(ax: Axes, states: Sequence[Sequence[torch.Tensor]], step: int) -> None:
    world = len(states)
    size = states[0][0].numel()
    per_chunk = size // world
    highlight = []
    if step:
        for rank in range(world):
            _, _, received = ring_steps(world, rank)[step - 1]
            highlight.append(range(received * per_chunk, (received + 1) * per_chunk))
    draw_rank_rows(ax, [s[step] for s in states], color=contributor_colors(world),
                   highlight=highlight, fmt="{:.0f}")
    if step == 0:
        title = "start"
    else:
        phase = ring_steps(world, 0)[step - 1][0]
        title = f"{phase} {(step - 1) % (world - 1) + 1}/{world - 1}"
    _frame(ax, size, world, title, rank_labels=True)


def plot_ring_steps(states: Sequence[Sequence[torch.Tensor]]) -> Figure:
    """The ring all-reduce step by step, from :func:`ddpguide.collectives.demos.ring_trace_demo`.

    ``states[r][s]`` is rank ``r``'s tensor after step ``s`` (0: before).
    Outlined: the chunk each rank received in that step.
    """
    world = len(states)
    fig, axes = plt.subplots(2, world, figsize=(2.6 * world, 2 * (0.9 + 0.45 * world)))
    _ring_panel(axes[0][0], states, 0)
    for s in range(1, world):
        _ring_panel(axes[0][s], states, s)
    axes[1][0].axis("off")
    axes[1][0].text(0.5, 0.5, "digit k (from the right)\nis 1 when rank k's\nvalue is in the sum",
                    ha="center", va="center", fontsize=9, transform=axes[1][0].transAxes)
    for s in range(world, 2 * world - 1):
        _ring_panel(axes[1][s - world + 1], states, s)
    fig.tight_layout()
    return fig


def ring_step_slider(states: Sequence[Sequence[torch.Tensor]]):
    """An ipywidgets slider over the steps of the ring (live in JupyterLab)."""
    import ipywidgets as widgets

    from ddpguide.core.widgets import live

    def show(step: int) -> Figure:
        fig, ax = plt.subplots(figsize=(4, 0.9 + 0.5 * len(states)))
        _ring_panel(ax, states, step)
        return fig

    steps = len(states[0]) - 1
    return live(show, {"step": widgets.IntSlider(0, 0, steps, 1, description="step")})


def plot_bandwidth(results: dict[int, dict[str, float]], world: int, cases: Sequence[str] | None = None
                   ) -> Figure:
    """Algorithmic bandwidth (bytes / time) and time relative to gloo, per message size.

    ``results`` is ``{bytes: {case: seconds}}`` as returned by
    :func:`ddpguide.bench.allreduce.measure`.
    """
    sizes = sorted(results)
    cases = list(cases or results[sizes[0]])
    fig, (bw, rel) = plt.subplots(1, 2, figsize=(11, 3.8))
    ratios = [results[n][c] / results[n]["gloo"] for n in sizes for c in cases]
    for case in cases:
        seconds = [results[n][case] for n in sizes]
        style = "-" if case == "gloo" else "--"
        bw.plot(sizes, [n / t / 1e9 for n, t in zip(sizes, seconds)], style, marker="o", label=case)
        rel.plot(sizes, [t / results[n]["gloo"] for n, t in zip(sizes, seconds)], style, marker="o",
                 label=case)
    for ax in (bw, rel):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_size_label(n) for n in sizes], rotation=45)
        ax.set_xlabel("tensor size")
        ax.grid(alpha=0.3)
    bw.set_ylabel("algorithmic bandwidth, GB/s")
    bw.set_title(f"all-reduce on {world} CPU ranks (gloo transport)")
    rel.set_yscale("log")
    rel.set_yticks([t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
                    if min(ratios) / 2 <= t <= max(ratios) * 2])
    rel.yaxis.set_major_formatter(ScalarFormatter())
    rel.yaxis.set_minor_formatter(NullFormatter())
    rel.set_ylabel("time / gloo's time")
    rel.axhline(1.0, color="black", linewidth=0.8)
    rel.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _size_label(nbytes: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
