"""The schedules of ``torch.distributed.pipelining`` as data: action lists, bubbles, memory.

:func:`compute_actions` gives each rank's forwards (F), full backwards (B),
backward-input (I) and backward-weight (W) passes in the order that rank runs
them, taken from the library's own ``pipeline_order`` for the multi-stage
schedules. :func:`simulate` plays them on an idealised machine (a forward or
a backward-input or a backward-weight of one chunk, one micro-batch through one
stage, takes one time unit, a full backward two, transfers take no time) and
counts the idle slots; :func:`bubble_formula` is the closed form each schedule
is known by. :func:`in_flight` counts the chunks whose activations a rank holds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from types import SimpleNamespace

import numpy as np

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
SINGLE = ("GPipe", "1F1B")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}


@dataclass(frozen=True)
class Op:
    """One compute action: ``kind`` F, B, I or W of micro-batch ``mb`` on stage ``stage``."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def stages_per_rank(schedule: str) -> int:
    """1 for GPipe and 1F1B, 2 (virtual stages) for the others."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return 1 if schedule in SINGLE else 2


@lru_cache(maxsize=512)
def _library(schedule: str, pp: int, m: int, with_comms: bool = False):
    """(the library's action lists, None) or (None, its refusal).

    The schedule is built as the library's ``_schedule_visualizer.get_schedule_ops``
    builds it, on stand-in stages (rank 0 of ``pp``); plain namespaces with the
    attributes the constructors read are 30 times faster than its mocks.
    """
    from torch.distributed.pipelining.schedules import get_schedule_class

    v = stages_per_rank(schedule)
    stages = [SimpleNamespace(group_rank=0, group_size=pp, num_stages=pp * v, submod=None)
              for _ in range(v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            instance = get_schedule_class(schedule)(stages if v > 1 else stages[0], m)
        except ValueError as exc:
            return None, " ".join(str(exc).split())
    order = instance.pipeline_order_with_comms if with_comms else instance.pipeline_order
    return tuple(tuple(order[r]) for r in range(pp)), None


def _library_ops(schedule: str, pp: int, m: int, with_comms: bool = False):
    ops, why = _library(schedule, pp, m, with_comms)
    if why is not None:
        raise ValueError(why)
    return ops


def library_refusal(schedule: str, pp: int, m: int) -> str | None:
    """The ``ValueError`` the library's constructor raises for m micro-batches on pp ranks."""
    stages_per_rank(schedule)
    return _library(schedule, pp, m)[1]


def compute_actions(schedule: str, pp: int, m: int) -> list[list[Op]]:
    """Each rank's compute actions in the order it runs them.

    GPipe and 1F1B are written out as their ``_step_microbatches`` runs them
    (1F1B: ``min(m, p - r)`` forwards, then one backward and one forward, then
    the remaining backwards): the ``pipeline_order`` the library keeps for
    drawing 1F1B numbers the last rank's forwards from 1 in torch 2.14.1. The
    others come from the library's ``pipeline_order``, an overlapped F+B of
    DualPipeV as its forward then its backward.
    """
    if (why := library_refusal(schedule, pp, m)) is not None:
        raise ValueError(why)
    if schedule == "GPipe":
        return [[Op(r, "F", i) for i in range(m)] + [Op(r, "B", i) for i in range(m)]
                for r in range(pp)]
    if schedule == "1F1B":
        ranks = []
        for r in range(pp):
            warmup = min(m, pp - r)
            order = [Op(r, "F", i) for i in range(warmup)]
            for i in range(m):
                order.append(Op(r, "B", i))
                if warmup + i < m:
                    order.append(Op(r, "F", warmup + i))
            ranks.append(order)
        return ranks
    ranks = []
    for actions in _library_ops(schedule, pp, m):
        order = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in COSTS:
                    order.append(Op(sub.stage_index, kind, sub.microbatch_index))
        ranks.append(order)
    return ranks


def comm_actions(schedule: str, pp: int, m: int) -> list[list[str]]:
    """The library's ``pipeline_order_with_comms`` per rank (multi-stage schedules only)."""
    if schedule in SINGLE:
        raise ValueError(f"{schedule} runs its own loop: the library keeps no action list with transfers")
    return [[str(a) for a in actions] for actions in _library_ops(schedule, pp, m, with_comms=True)]


@dataclass
class Timeline:
    """A schedule played on the idealised machine: ``grid[r, t]`` is the action rank r
    runs in time unit t (None when idle)."""

    schedule: str
    pp: int
    microbatches: int
    grid: np.ndarray

    @property
    def makespan(self) -> int:
        return self.grid.shape[1]

    @property
    def idle(self) -> int:
        return int(sum(op is None for op in self.grid.flat))

    @property
    def busy(self) -> int:
        return self.grid.size - self.idle

    @property
    def bubble(self) -> Fraction:
        """Idle time over compute time, all ranks together: (p-1)/m for 1F1B."""
        return Fraction(self.idle, self.busy)


def simulate(schedule: str, pp: int, m: int) -> Timeline:
    """Play each rank's actions in order, each as soon as its input is ready.

    F(s, i) waits for F(s-1, i); B or I of (s, i) for B or I of (s+1, i) (the
    last stage for its own forward); W(s, i) for I(s, i).
    """
    ranks = compute_actions(schedule, pp, m)
    n_stages = pp * stages_per_rank(schedule)
    done: dict[tuple[int, str, int], int] = {}
    free, pos, spans = [0] * pp, [0] * pp, []
    while any(p < len(r) for p, r in zip(pos, ranks)):
        moved = False
        for r, order in enumerate(ranks):
            while pos[r] < len(order):
                op = order[pos[r]]
                if op.kind == "F":
                    deps = [(op.stage - 1, "F", op.mb)] if op.stage else []
                elif op.kind == "W":
                    deps = [(op.stage, "I", op.mb)]
                elif op.stage == n_stages - 1:
                    deps = [(op.stage, "F", op.mb)]
                else:
                    deps = [(op.stage + 1, k, op.mb) for k in "BI" if (op.stage + 1, k, op.mb) in done]
                    deps = deps or [(op.stage + 1, "I", op.mb)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                free[r] = done[(op.stage, op.kind, op.mb)] = start + COSTS[op.kind]
                spans.append((r, start, free[r], op))
                pos[r] += 1
                moved = True
        if not moved:  # pragma: no cover - only a broken order deadlocks
            raise RuntimeError(f"{schedule} deadlocks")
    grid = np.full((pp, max(free)), None, dtype=object)
    for r, start, end, op in spans:
        grid[r, start:end] = [op] * (end - start)
    return Timeline(schedule, pp, m, grid)


def bubble_formula(schedule: str, pp: int, m: int) -> Fraction:
    """The closed form of idle over compute time, with F = I = W = 1, B = I + W.

    GPipe, 1F1B and looped BFS: (p-1)/m (the pipeline fills and drains once,
    (p-1)(F+B) per rank, against m(F+B) of work); interleaved 1F1B: (p-1)/(v m)
    (the same fill with chunks 1/v as long); the zero-bubble schedules fill the
    drain with W passes and leave (p-1)(F+I-W) per rank: (p-1)/(3 v m). The
    looped schedules reach it from m >= p on, ZBV from m >= 2p - 1 (the
    micro-batches its V needs), DualPipeV from its least m = 2p; below, more idles.
    """
    v = stages_per_rank(schedule)
    if schedule in ("GPipe", "1F1B"):
        return Fraction(pp - 1, m)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return Fraction(pp - 1, v * m)
    return Fraction(pp - 1, 3 * v * m)


def formula_holds(schedule: str, pp: int, m: int) -> bool:
    """Whether m is large enough for :func:`bubble_formula` (see there)."""
    least = {"Interleaved1F1B": pp, "LoopedBFS": pp, "InterleavedZeroBubble": pp,
             "ZBVZeroBubble": 2 * pp - 1}
    return m >= least.get(schedule, 1)


def in_flight(schedule: str, pp: int, m: int, until: str = "last") -> list[int]:
    """Per rank, the most chunks whose forward ran and whose backward did not finish.

    ``until="last"``: a chunk is held until its last backward action (B, or W
    after I); ``until="I"``: until its B or I.
    """
    peaks = []
    for order in compute_actions(schedule, pp, m):
        held = peak = 0
        for op in order:
            if op.kind == "F":
                held += 1
            elif op.kind == "B" or (op.kind == "W") == (until == "last"):
                held -= 1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
