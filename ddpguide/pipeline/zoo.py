"""The schedules of ``torch.distributed.pipelining`` as data: action lists, bubbles, memory.

:func:`compute_actions` gives each rank's forwards (F), full backwards (B),
backward-input (I) and backward-weight (W) passes in the order that rank runs
them, taken from the library's own ``pipeline_order`` for the multi-stage
schedules. :func:`simulate` plays them on the idealised machine of
:mod:`ddpguide.pipeline.timeline` (by default a forward, a backward-input or a
backward-weight of one chunk, one micro-batch through one stage, takes one time
unit, a full backward two, transfers take no time) and counts the bubble, idle
over busy time; :func:`bubble_formula` is the closed form each schedule is
known by. :func:`in_flight` counts the chunks whose activations a rank holds.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from functools import lru_cache
from types import SimpleNamespace

from ddpguide.pipeline import timeline
from ddpguide.pipeline.timeline import KINDS, Costs, Op, Timeline

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
SINGLE = ("GPipe", "1F1B")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


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
                if kind in KINDS:
                    order.append(Op(sub.stage_index, kind, sub.microbatch_index))
        ranks.append(order)
    return ranks


def comm_actions(schedule: str, pp: int, m: int) -> list[list[str]]:
    """The library's ``pipeline_order_with_comms`` per rank (multi-stage schedules only)."""
    if schedule in SINGLE:
        raise ValueError(f"{schedule} runs its own loop: the library keeps no action list with transfers")
    return [[str(a) for a in actions] for actions in _library_ops(schedule, pp, m, with_comms=True)]


def simulate(schedule: str, pp: int, m: int, costs: Costs | None = None) -> Timeline:
    """The schedule's action lists played by :func:`ddpguide.pipeline.timeline.simulate`."""
    return timeline.simulate(compute_actions(schedule, pp, m), pp * stages_per_rank(schedule),
                             costs, schedule, m)


def bubble_formula(schedule: str, pp: int, m: int) -> Fraction:
    """The closed form of the bubble (idle over busy time) each schedule is known by.

    GPipe and 1F1B: (p-1)/m (the pipeline fills and drains once, (p-1)(F+B) per
    rank, against m(F+B) of work); interleaved 1F1B and looped BFS: (p-1)/(v m)
    (the same fill with chunks 1/v as long). These hold at any F and B. The
    zero-bubble schedules fill the drain with W passes and leave the fill, a
    forward per hop, (p-1)F per rank: (p-1)/(3 v m), which holds only at
    F = I = W (at other costs the simulator counts more, never less than (p-1)F).
    The looped schedules reach their formula from m >= p on, ZBV from m >= 2p - 1
    (the micro-batches its V needs), DualPipeV from its least m = 2p; below,
    more idles.
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
    """Per rank, the most chunks held at once (:func:`ddpguide.pipeline.timeline.in_flight`)."""
    return timeline.in_flight(compute_actions(schedule, pp, m), until)


def held_until_step_end(schedule: str, pp: int, m: int, share: Fraction = Fraction(1, 2)) -> list[Fraction]:
    """Per rank, :func:`ddpguide.pipeline.timeline.held_until_step_end` on the schedule's lists."""
    return timeline.held_until_step_end(compute_actions(schedule, pp, m), share)
