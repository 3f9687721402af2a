"""Pipeline schedules as stages-by-time charts: GPipe and 1F1B, their bubble and memory.

:func:`simulate` runs the per-stage order of a schedule (the order
``torch.distributed.pipelining`` executes) on an idealised machine where each
forward takes ``forward_cost`` time units and each backward ``backward_cost``
on every stage, and every operation starts as soon as its input is ready. The
result is a grid of stages x time slots that :func:`plot_schedules` draws and
:func:`schedule_widget` puts behind sliders.

With uniform stages, both schedules leave each stage idle for
``(p - 1) / (m + p - 1)`` of the time (:func:`bubble_fraction`); 1F1B does not
shrink the bubble, it caps the activations a stage holds at ``p - s`` micro-
batches instead of ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def bubble_fraction(stages: int, microbatches: int) -> Fraction:
    """Idle share of a uniform pipeline: ``(p - 1) / (m + p - 1)``."""
    _check(stages, microbatches)
    return Fraction(stages - 1, microbatches + stages - 1)


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got p={stages}, m={microbatches}")


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[str]:
    """The operations of one stage in execution order, e.g. ``['F0', 'F1', 'B0', ...]``.

    GPipe: every forward, then every backward. 1F1B: ``min(m, p - s)`` forwards
    to fill the pipe, then alternate one backward and one forward, then the
    remaining backwards (as ``Schedule1F1B`` runs it).
    """
    _check(stages, microbatches)
    m = microbatches
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, stages - stage)
        order = [f"F{i}" for i in range(warmup)]
        for i in range(m):
            order.append(f"B{i}")
            if warmup + i < m:
                order.append(f"F{warmup + i}")
        return order
    raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULE_NAMES)}")


@dataclass
class Timeline:
    """A simulated schedule: ``grid[s, t]`` is the operation stage ``s`` runs in slot ``t``
    (``''`` when idle); ``in_flight[s]`` is the most micro-batches whose activations
    stage ``s`` held at once."""

    schedule: str
    stages: int
    microbatches: int
    grid: np.ndarray
    in_flight: list[int]

    @property
    def makespan(self) -> int:
        return self.grid.shape[1]

    @property
    def idle_cells(self) -> int:
        return int((self.grid == "").sum())

    @property
    def idle_fraction(self) -> Fraction:
        return Fraction(self.idle_cells, self.grid.size)


def simulate(schedule: str, stages: int, microbatches: int,
             forward_cost: int = 1, backward_cost: int = 2) -> Timeline:
    """Run a schedule on ``stages`` stages with ``microbatches`` micro-batches.

    F(s, i) waits for F(s-1, i); B(s, i) waits for B(s+1, i) (the last stage for
    its own F(s, i)); each stage runs its :func:`stage_order` one operation at a time.
    """
    if forward_cost < 1 or backward_cost < 1:
        raise ValueError("operation costs must be at least one time unit")
    orders = [stage_order(schedule, stages, microbatches, s) for s in range(stages)]
    finish: dict[tuple[int, str], int] = {}
    free_at = [0] * stages
    position = [0] * stages
    spans: list[tuple[int, int, int, str]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            op = orders[s][position[s]]
            kind, i = op[0], op[1:]
            if kind == "F":
                dep = (s - 1, op) if s > 0 else None
            else:
                dep = (s + 1, op) if s < stages - 1 else (s, f"F{i}")
            if dep is not None and dep not in finish:
                continue
            start = max(free_at[s], finish[dep] if dep else 0)
            end = start + (forward_cost if kind == "F" else backward_cost)
            finish[(s, op)] = free_at[s] = end
            spans.append((s, start, end, op))
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:  # pragma: no cover - only a broken order can deadlock
            raise RuntimeError(f"schedule {schedule!r} deadlocks")
    grid = np.full((stages, max(free_at)), "", dtype=object)
    for s, start, end, op in spans:
        grid[s, start:end] = op
    return Timeline(schedule, stages, microbatches, grid, [_peak_in_flight(o) for o in orders])


def _peak_in_flight(order: list[str]) -> int:
    held = peak = 0
    for op in order:
        held += 1 if op[0] == "F" else -1
        peak = max(peak, held)
    return peak


def plot_schedules(stages: int = 4, microbatches: int = 8, schedules=("gpipe", "1f1b"),
                   forward_cost: int = 1, backward_cost: int = 2, ax=None):
    """Draw each schedule as stages x time: forwards blue, backwards orange, idle white.

    Returns the matplotlib figure; titles give the idle fraction and the
    activations the first stage holds.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    timelines = [simulate(s, stages, microbatches, forward_cost, backward_cost) for s in schedules]
    if ax is None:
        fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.1 + 0.45 * stages * len(timelines)),
                                 squeeze=False)
        axes = axes[:, 0]
    else:
        axes = np.atleast_1d(ax)
        fig = axes[0].figure
    shades = {"F": np.array(to_rgb("tab:blue")), "B": np.array(to_rgb("tab:orange"))}
    for axis, tl in zip(axes, timelines):
        image = np.ones((tl.stages, tl.makespan, 3))
        for (s, t), op in np.ndenumerate(tl.grid):
            if op:
                # Later micro-batches a little lighter, so neighbours stay distinguishable.
                lift = 0.45 * int(op[1:]) / max(1, tl.microbatches - 1)
                image[s, t] = shades[op[0]] + (1 - shades[op[0]]) * lift
        axis.imshow(image, aspect="auto", interpolation="nearest")
        if tl.makespan <= 60:
            for s in range(tl.stages):
                t = 0
                while t < tl.makespan:  # one label per operation, centred on its span
                    op, start = tl.grid[s, t], t
                    while t < tl.makespan and tl.grid[s, t] == op:
                        t += 1
                    if op:
                        axis.text((start + t - 1) / 2, s, op, ha="center", va="center", fontsize=7)
        axis.set_yticks(range(tl.stages), [f"stage {s}" for s in range(tl.stages)])
        axis.set_xlabel("time (forward = 1 unit)")
        axis.set_title(
            f"{SCHEDULE_NAMES[tl.schedule]}: p={tl.stages}, m={tl.microbatches}, "
            f"idle {float(tl.idle_fraction):.0%} "
            f"(formula (p-1)/(m+p-1) = {float(bubble_fraction(tl.stages, tl.microbatches)):.0%}), "
            f"stage 0 holds {tl.in_flight[0]} micro-batches",
            fontsize=9,
        )
    fig.tight_layout()
    return fig


def schedule_widget(stages: int = 4, microbatches: int = 8):
    """Sliders for p and m, and the backward cost, redrawing both schedules (live in JupyterLab)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def draw(stages: int, microbatches: int, backward_cost: int) -> None:
        fig = plot_schedules(stages, microbatches, backward_cost=backward_cost)
        plt.show()
        plt.close(fig)

    return widgets.interactive(
        draw,
        stages=widgets.IntSlider(value=stages, min=1, max=8, description="stages p"),
        microbatches=widgets.IntSlider(value=microbatches, min=1, max=16, description="micro-batches m"),
        backward_cost=widgets.IntSlider(value=2, min=1, max=3, description="backward cost"),
    )


ACTION_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:cyan", "W": "tab:green"}


def plot_action_timelines(pp: int = 4, microbatches: int = 8, schedules=None, axes=None):
    """Each library schedule's action list played with unit costs, one row per rank.

    F blue, full backward B orange (two units), backward-input I cyan, backward-
    weight W green, idle white; a rank's second (virtual) stage is drawn darker,
    each cell is labelled with its micro-batch. Titles give the idle slots counted
    against the formula (:mod:`ddpguide.pipeline.zoo`).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    from ddpguide.pipeline import zoo

    names = schedules or [s for s in zoo.SCHEDULES if zoo.library_refusal(s, pp, microbatches) is None]
    timelines = [zoo.simulate(s, pp, microbatches) for s in names]
    if axes is None:
        fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 0.6 + 0.42 * pp * len(timelines)),
                                 squeeze=False)
        axes = axes[:, 0]
    fig = axes[0].figure
    width = max(tl.makespan for tl in timelines)
    for axis, tl in zip(axes, timelines):
        image = np.ones((pp, width, 3))
        for (r, t), op in np.ndenumerate(tl.grid):
            if op is not None:
                colour = np.array(to_rgb(ACTION_COLOURS[op.kind]))
                image[r, t] = colour * 0.6 if op.stage >= pp else colour
        axis.imshow(image, aspect="auto", interpolation="nearest")
        for (r, t), op in np.ndenumerate(tl.grid):
            if op is not None and (t == 0 or tl.grid[r, t - 1] is not op):
                axis.text(t + (op.kind == "B") * 0.5, r, str(op.mb), ha="center", va="center",
                          fontsize=6, color="white")
        axis.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=7)
        axis.set_xticks([])
        formula = zoo.bubble_formula(tl.schedule, pp, microbatches)
        axis.set_title(f"{tl.schedule}: idle/compute {tl.idle}/{tl.busy} = {float(tl.bubble):.3f}"
                       f" (formula {formula} = {float(formula):.3f})", fontsize=8, loc="left")
    axes[-1].set_xlabel("time (one chunk's forward = 1 unit)")
    fig.tight_layout()
    return fig
