"""Boxing rules: which step turns one SBP into another, and what it sends.

When the SBP a tensor has is not the SBP the next operator needs, something
must move data between ranks. OneFlow calls that *boxing*; DTensor calls it
``redistribute``. On one mesh dimension of ``n`` ranks there are few cases,
and each is one collective or a purely local step:

=============  ====================  ==========================================
from -> to     how                   bytes each rank sends (N = logical bytes)
=============  ====================  ==========================================
S(i) -> B      all-gather            (n-1)/n N
P -> B         all-reduce            2(n-1)/n N (ring: reduce-scatter + all-gather)
P -> S(i)      reduce-scatter        (n-1)/n N
S(i) -> S(j)   all-to-all            (n-1)/n^2 N
B -> S(i)      local slice           0
B -> P         local scale (x / n)   0
S(i) -> P      local zero-fill       0
=============  ====================  ==========================================

:data:`RULES` holds this table as data, :func:`rule` looks a pair up and
:func:`rule_table` renders it. What is not allowed: changing the kind of a
pending reduction (``P(sum) -> P(max)``): the summands cannot be turned into
maximands without first doing the sum, so go through ``B``. The rules cover
``P(sum)`` only. DTensor's public ``redistribute`` also refuses ``B -> P``
(``distribute_tensor`` makes ``P`` by ``x / n``); here it is allowed.

On a 2D mesh, boxing converts one mesh dimension at a time (:func:`plan`).
Splits that are *nested* (a later mesh dimension cutting the piece an earlier
one left) are undone inner-first, as DTensor does, so each step sees the
logical shape it expects. Nothing here moves data;
:mod:`ddpguide.sbp.boxing_by_hand` carries the steps out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ddpguide.sbp.placements import sbp_name, sbp_names


class BoxingError(ValueError):
    """This SBP change is not one boxing step (or not one the hand-written boxing covers)."""


@dataclass(frozen=True)
class Rule:
    """How one mesh dimension goes from one SBP kind to another."""

    src: str
    dst: str
    how: str
    traffic: Callable[[int], float]
    why: str

    @property
    def collective(self) -> str | None:
        """The collective's name, or None for a local step."""
        return None if self.how.startswith(("local", "nothing")) else self.how


def _zero(n: int) -> float:
    return 0.0


# Keys use "S" for a split and "S'" for a split on another tensor dimension.
_RULE_LIST = (
    Rule("B", "B", "nothing", _zero, "already there"),
    Rule("B", "S", "local slice", _zero, "every rank has it all; keep your chunk"),
    Rule("B", "P", "local scale", _zero, "each rank keeps x / n; the n summands add back to x"),
    Rule("S", "B", "all_gather", lambda n: (n - 1) / n, "each rank needs every other chunk"),
    Rule("S", "S", "nothing", _zero, "already there"),
    Rule("S", "S'", "all_to_all", lambda n: (n - 1) / n ** 2,
         "cut your chunk the other way and send piece k to rank k"),
    Rule("S", "P", "local zero-fill", _zero, "your chunk in place, zeros elsewhere; they sum to x"),
    Rule("P", "B", "all_reduce", lambda n: 2 * (n - 1) / n, "every rank needs the full sum"),
    Rule("P", "S", "reduce_scatter", lambda n: (n - 1) / n, "each rank needs the sum of its chunk only"),
    Rule("P", "P", "nothing", _zero, "already there"),
)
RULES: dict[tuple[str, str], Rule] = {(r.src, r.dst): r for r in _RULE_LIST}


def _kind(placement: Placement) -> str:
    if isinstance(placement, Replicate):
        return "B"
    if isinstance(placement, Shard):
        return "S"
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise BoxingError(
                f"hand-written boxing covers P(sum) only, got {sbp_name(placement)}"
            )
        return "P"
    raise BoxingError(f"unknown placement {placement!r}")


def rule(src: Placement, dst: Placement) -> Rule:
    """The :class:`Rule` for one mesh dimension going from ``src`` to ``dst``."""
    if isinstance(src, Partial) and isinstance(dst, Partial) and src.reduce_op != dst.reduce_op:
        raise BoxingError(
            f"{sbp_name(src)} -> {sbp_name(dst)} would change the pending reduction; "
            f"reduce first ({sbp_name(src)} -> B), then B -> {sbp_name(dst)}"
        )
    a, b = _kind(src), _kind(dst)
    if isinstance(src, Shard) and isinstance(dst, Shard) and src.dim != dst.dim:
        b = "S'"
    return RULES[(a, b)]


# ---------------------------------------------------------------- several mesh dimensions

@dataclass(frozen=True)
class Step:
    """Change mesh dimension ``mesh_dim`` from ``src`` to ``dst``."""

    mesh_dim: int
    src: Placement
    dst: Placement

    def __str__(self) -> str:
        r = rule(self.src, self.dst)
        return f"mesh dim {self.mesh_dim}: {sbp_name(self.src)} -> {sbp_name(self.dst)} ({r.how})"


def plan(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Step]:
    """The steps, one mesh dimension each, that take ``src`` to ``dst``.

    A split that sits under an earlier mesh dimension's split of the same
    tensor dimension is nested; if the target nests differently it is first
    gathered (inner dims first), then the remaining changes run outer to inner.
    This mirrors DTensor's greedy planner, so the partial values match too.
    """
    if len(src) != len(dst):
        raise BoxingError(f"{sbp_names(src)} and {sbp_names(dst)} have different mesh ranks")
    for a, b in zip(src, dst):
        rule(a, b)  # reject what is not allowed before touching data
    current = list(src)
    steps: list[Step] = []
    if any(isinstance(p, Shard) for p in src):
        for mesh_dim in reversed(range(len(src))):
            target = dst[mesh_dim]
            if isinstance(target, Shard):
                before_now = [i for i in range(mesh_dim) if current[i] == Shard(target.dim)]
                before_want = [i for i in range(mesh_dim) if dst[i] == Shard(target.dim)]
                if before_now != before_want:
                    target = Replicate()
            if current[mesh_dim] != target:
                steps.append(Step(mesh_dim, current[mesh_dim], target))
                current[mesh_dim] = target
    for mesh_dim, target in enumerate(dst):
        if current[mesh_dim] != target:
            steps.append(Step(mesh_dim, current[mesh_dim], target))
            current[mesh_dim] = target
    return steps


# ---------------------------------------------------------------- tables

def rule_table(n: int, nbytes: int, kinds: Sequence[Placement] | None = None) -> list[dict]:
    """Every 1D pair with its method and bytes sent per rank, for a tensor of ``nbytes``."""
    kinds = list(kinds or (Replicate(), Shard(0), Shard(1), Partial()))
    rows = []
    for src in kinds:
        for dst in kinds:
            r = rule(src, dst)
            rows.append({"from": sbp_name(src), "to": sbp_name(dst), "how": r.how,
                         "bytes sent per rank": int(round(r.traffic(n) * nbytes)), "why": r.why})
    return rows


def markdown_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """A list of dicts as a Markdown table (for ``IPython.display.Markdown``)."""
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
