"""One idealised machine for every pipeline schedule: action lists played in time.

A schedule is, per rank, the list of compute actions the rank runs in order: the
forward (F) of one micro-batch through one stage, its full backward (B), or the
backward split in two, backward-input (I) and backward-weight (W). :func:`simulate`
plays these lists on a machine where each action of a kind costs the same whole
number of time units (:class:`Costs`), transfers cost nothing, and every action
starts as soon as its rank is free and its input is ready:

* F of (stage s, micro-batch i) after F of (s - 1, i);
* B or I of (s, i) after B or I of (s + 1, i), on the last stage after its own F;
* W of (s, i) after I of (s, i).

**The bubble** is the idle time over the busy (compute) time, all ranks together
(:attr:`Timeline.bubble`). It is the ratio by which a step is longer than its work:
the step takes ``(1 + bubble)`` times the compute each rank does. GPipe and 1F1B
leave each of p stages ``(p - 1)(F + B)`` idle against ``m(F + B)`` of work, a
bubble of ``(p - 1)/m``, whatever F and B cost; the share of the step a stage idles,
``(p - 1)/(m + p - 1)``, is ``bubble / (1 + bubble)``.

The library's own action lists and the closed forms per schedule are in
:mod:`ddpguide.pipeline.zoo`; the figures that draw timelines in
:mod:`ddpguide.pipeline.viz`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Op:
    """One compute action: ``kind`` F, B, I or W of micro-batch ``mb`` on stage ``stage``."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Costs:
    """Time units of one chunk's F, I and W (one micro-batch through one stage); a full
    backward B costs ``B``, by default ``I + W``."""

    F: int = 1
    I: int = 1  # noqa: E741 - the name the schedules give the backward-input pass
    W: int = 1
    B: int | None = None

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"cost {kind} must be a whole number of time units >= 1, got {value!r}")

    def of(self, kind: str) -> int:
        """The cost of one action of ``kind``."""
        if kind == "B":
            return self.B if self.B is not None else self.I + self.W
        return int(getattr(self, kind))


@dataclass
class Timeline:
    """A schedule played on the idealised machine: ``grid[r, t]`` is the action rank r
    runs in time unit t (None when idle)."""

    schedule: str
    pp: int
    microbatches: int
    grid: np.ndarray
    costs: Costs

    @property
    def makespan(self) -> int:
        return self.grid.shape[1]

    @property
    def idle(self) -> int:
        """Idle time units, all ranks together."""
        return int(sum(op is None for op in self.grid.flat))

    @property
    def busy(self) -> int:
        """Compute time units, all ranks together."""
        return self.grid.size - self.idle

    @property
    def bubble(self) -> Fraction:
        """Idle over busy time, all ranks together: ``(p - 1)/m`` for GPipe and 1F1B."""
        return Fraction(self.idle, self.busy)

    def idle_per_rank(self) -> list[int]:
        return [int(sum(op is None for op in row)) for row in self.grid]


def dependencies(op: Op, n_stages: int, done: dict[tuple[int, str, int], int]) -> list[tuple[int, str, int]]:
    """The actions ``op`` waits for (see the module docstring)."""
    if op.kind == "F":
        return [(op.stage - 1, "F", op.mb)] if op.stage else []
    if op.kind == "W":
        return [(op.stage, "I", op.mb)]
    if op.stage == n_stages - 1:
        return [(op.stage, "F", op.mb)]
    found = [(op.stage + 1, k, op.mb) for k in "BI" if (op.stage + 1, k, op.mb) in done]
    return found or [(op.stage + 1, "I", op.mb)]


def simulate(ranks: Sequence[Sequence[Op]], n_stages: int, costs: Costs | None = None,
             schedule: str = "", microbatches: int = 0) -> Timeline:
    """Play each rank's actions in order, each as soon as its rank is free and its input ready."""
    costs = costs or Costs()
    done: dict[tuple[int, str, int], int] = {}
    free, pos = [0] * len(ranks), [0] * len(ranks)
    spans: list[tuple[int, int, int, Op]] = []
    while any(p < len(r) for p, r in zip(pos, ranks)):
        moved = False
        for r, order in enumerate(ranks):
            while pos[r] < len(order):
                op = order[pos[r]]
                deps = dependencies(op, n_stages, done)
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = done[(op.stage, op.kind, op.mb)] = start + costs.of(op.kind)
                spans.append((r, start, free[r], op))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule or 'the schedule'} deadlocks: every rank waits for an input")
    grid = np.full((len(ranks), max(free, default=0)), None, dtype=object)
    for r, start, end, op in spans:
        grid[r, start:end] = [op] * (end - start)
    return Timeline(schedule, len(ranks), microbatches, grid, costs)


def in_flight(ranks: Sequence[Sequence[Op]], until: str = "last") -> list[int]:
    """Per rank, the most chunks whose forward ran and whose backward did not finish.

    ``until="last"``: a chunk is held until its last backward action (B, or W after
    I); ``until="I"``: until its B or I.
    """
    if until not in ("last", "I"):
        raise ValueError(f"until must be 'last' or 'I', got {until!r}")
    peaks = []
    for order in ranks:
        held = peak = 0
        for op in order:
            if op.kind == "F":
                held += 1
            elif op.kind == "B" or (op.kind == "W") == (until == "last"):
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def held_until_step_end(ranks: Sequence[Sequence[Op]], share: Fraction = Fraction(1, 2)) -> list[Fraction]:
    """Per rank, the peak of chunks held when each chunk is held in full until its last
    backward action and ``share`` of it from its W to the end of the step.

    With ``share = 1/2`` this bounds the zero-bubble schedules' measured peaks in
    torch 2.14.1: W's ``autograd.grad`` over the weights frees the Linear's saved
    input, not the tensors on the input path that I kept with ``retain_graph=True``
    (one of a block's two), which go when the graph goes.
    """
    peaks = []
    for order in ranks:
        held = peak = Fraction(0)
        for op in order:
            if op.kind == "F":
                held += 1
            elif op.kind == "B":
                held -= 1
            elif op.kind == "W":
                held -= 1 - share
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
