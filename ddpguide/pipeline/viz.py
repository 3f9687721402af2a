"""Pipeline timelines drawn as ranks x time: the figures of chapters 5 and 13.

Every figure draws a :class:`ddpguide.pipeline.timeline.Timeline`, a schedule's
action lists (:mod:`ddpguide.pipeline.zoo`) played on the idealised machine of
:mod:`ddpguide.pipeline.timeline`; titles give its bubble, idle over busy time.
"""

from __future__ import annotations

import numpy as np

from ddpguide.pipeline import zoo
from ddpguide.pipeline.timeline import Costs, Timeline

#: Chapter 5's costs: a backward takes twice a forward.
FORWARD_BACKWARD = Costs(F=1, B=2)
ACTION_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:cyan", "W": "tab:green"}


def _axes(count: int, rows: int, width: float, axes):
    import matplotlib.pyplot as plt

    if axes is None:
        fig, grid = plt.subplots(count, 1, figsize=(width, 0.6 + 0.45 * rows * count), squeeze=False)
        return fig, list(grid[:, 0])
    axes = list(np.atleast_1d(axes))
    return axes[0].figure, axes


def _draw(axis, tl: Timeline, width: int, label) -> None:
    """Colour each busy cell by its kind (a rank's second stage darker) and label each action."""
    from matplotlib.colors import to_rgb

    image = np.ones((tl.pp, width, 3))
    for (r, t), op in np.ndenumerate(tl.grid):
        if op is not None:
            colour = np.array(to_rgb(ACTION_COLOURS[op.kind]))
            image[r, t] = colour * 0.6 if op.stage >= tl.pp else colour
    axis.imshow(image, aspect="auto", interpolation="nearest")
    if width <= 80:
        for (r, t), op in np.ndenumerate(tl.grid):
            if op is not None and (t == 0 or tl.grid[r, t - 1] is not op):
                span = tl.costs.of(op.kind)
                axis.text(t + (span - 1) / 2, r, label(op), ha="center", va="center", fontsize=6,
                          color="white")


def plot_schedules(stages: int = 4, microbatches: int = 8, schedules=("GPipe", "1F1B"),
                   costs: Costs = FORWARD_BACKWARD, axes=None):
    """GPipe and 1F1B as stages x time: forwards blue, backwards orange, idle white.

    Titles give the bubble (idle over busy time) counted on the chart, the formula
    (p-1)/m, and the micro-batches whose activations stage 0 holds at the peak.
    """
    timelines = [zoo.simulate(s, stages, microbatches, costs) for s in schedules]
    fig, axes = _axes(len(timelines), stages, 10, axes)
    for axis, tl in zip(axes, timelines):
        _draw(axis, tl, tl.makespan, lambda op: f"{op.kind}{op.mb}")
        axis.set_yticks(range(tl.pp), [f"stage {s}" for s in range(tl.pp)])
        axis.set_xlabel(f"time (forward = {costs.F} unit, backward = {costs.of('B')})")
        axis.set_title(
            f"{tl.schedule}: p={tl.pp}, m={tl.microbatches}, bubble {tl.idle}/{tl.busy} = "
            f"{float(tl.bubble):.0%} (formula (p-1)/m = "
            f"{float(zoo.bubble_formula(tl.schedule, stages, microbatches)):.0%}), "
            f"stage 0 holds {zoo.in_flight(tl.schedule, stages, microbatches)[0]} micro-batches",
            fontsize=9)
    fig.tight_layout()
    return fig


def schedule_widget(stages: int = 4, microbatches: int = 8):
    """Sliders for p and m, and the backward cost, redrawing both schedules (live in JupyterLab).

    A schedule the library refuses for these p and m is left out, and its ``ValueError`` is
    shown above the chart.
    """
    import html

    import ipywidgets as widgets

    from ddpguide.core.widgets import live

    def draw(stages: int, microbatches: int, backward_cost: int):
        refused = {n: zoo.library_refusal(n, stages, microbatches) for n in ("GPipe", "1F1B")}
        names = [n for n, why in refused.items() if why is None]
        note = "".join(f"<p>{n}: {html.escape(why)}</p>" for n, why in refused.items() if why is not None)
        return note, plot_schedules(stages, microbatches, names, costs=Costs(F=1, B=backward_cost))

    return live(draw, {
        "stages": widgets.IntSlider(value=stages, min=2, max=8, description="stages p"),
        "microbatches": widgets.IntSlider(value=microbatches, min=1, max=16, description="micro-batches m"),
        "backward_cost": widgets.IntSlider(value=2, min=1, max=3, description="backward cost"),
    })


def plot_action_timelines(pp: int = 4, microbatches: int = 8, schedules=None,
                          costs: Costs | None = None, axes=None):
    """Each library schedule's action list played on the idealised machine, one row per rank.

    F blue, full backward B orange, backward-input I cyan, backward-weight W green,
    idle white; a rank's second (virtual) stage is drawn darker, each action is
    labelled with its micro-batch. Titles give the bubble counted against the formula.
    """
    names = schedules or [s for s in zoo.SCHEDULES if zoo.library_refusal(s, pp, microbatches) is None]
    timelines = [zoo.simulate(s, pp, microbatches, costs) for s in names]
    fig, axes = _axes(len(timelines), pp, 11, axes)
    width = max(tl.makespan for tl in timelines)
    for axis, tl in zip(axes, timelines):
        _draw(axis, tl, width, lambda op: str(op.mb))
        axis.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=7)
        axis.set_xticks([])
        formula = zoo.bubble_formula(tl.schedule, pp, microbatches)
        against = (f"formula {formula} = {float(formula):.3f}" if tl.costs == Costs()
                   else f"F={tl.costs.F}, I={tl.costs.I}, W={tl.costs.W}, B={tl.costs.of('B')}")
        axis.set_title(f"{tl.schedule}: idle/compute {tl.idle}/{tl.busy} = {float(tl.bubble):.3f}"
                       f" ({against})", fontsize=8, loc="left")
    axes[-1].set_xlabel(f"time (one chunk's forward = {timelines[0].costs.F} unit)")
    fig.tight_layout()
    return fig
