"""Boxing by hand: turning one SBP into another with plain ``torch.distributed`` calls.

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

:data:`RULES` holds this table as data; :func:`rule_table` renders it, and the
functions below implement it. What is not allowed: changing the kind of a
pending reduction (``P(sum) -> P(max)``): the summands cannot be turned into
maximands without first doing the sum, so go through ``B``. The hand-written
code covers ``P(sum)`` only. DTensor's public ``redistribute`` also refuses
``B -> P`` (``distribute_tensor`` makes ``P`` by ``x / n``); here it is allowed.

On a 2D mesh, boxing converts one mesh dimension at a time using that
dimension's process group (:func:`plan`). Splits that are *nested* (a later
mesh dimension cutting the piece an earlier one left) are undone inner-first,
as DTensor does, so each step sees the logical shape it expects.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .sbp import chunk_bounds, logical_shapes, sbp_name, sbp_names


class BoxingError(ValueError):
    """This SBP change is not one boxing step (or not one this module writes by hand)."""


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
    if a == b == "S" and src.dim != dst.dim:
        b = "S'"
    return RULES[(a, b)]


# ---------------------------------------------------------------- recording the traffic

@dataclass(frozen=True)
class CommEvent:
    """One collective this rank took part in, and the bytes it sent to other ranks."""

    collective: str
    mesh_dim: int
    bytes_sent: int


_EVENTS: contextvars.ContextVar[list[CommEvent] | None] = contextvars.ContextVar("_EVENTS", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[CommEvent]]:
    """Collect a :class:`CommEvent` for every collective the boxing functions run."""
    events: list[CommEvent] = []
    token = _EVENTS.set(events)
    try:
        yield events
    finally:
        _EVENTS.reset(token)


def _record(collective: str, mesh_dim: int, bytes_sent: float) -> None:
    events = _EVENTS.get()
    if events is not None:
        events.append(CommEvent(collective, mesh_dim, int(round(bytes_sent))))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- one mesh dimension

def _padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` grown with zeros to ``size`` along ``dim``: collectives want equal shapes."""
    missing = size - t.size(dim)
    if missing > 0:
        shape = list(t.shape)
        shape[dim] = missing
        t = torch.cat([t, t.new_zeros(shape)], dim)
    return t.contiguous()


def _chunk(t: torch.Tensor, dim: int, n: int, index: int) -> torch.Tensor:
    start, stop = chunk_bounds(t.size(dim), n, index)
    return t.narrow(dim, start, stop - start)


@dataclass(frozen=True)
class _Axis:
    """One mesh dimension as this rank sees it."""

    group: dist.ProcessGroup | None
    size: int
    coord: int
    mesh_dim: int


def gather_shards(local: torch.Tensor, dim: int, logical: int, axis: _Axis) -> torch.Tensor:
    """S(dim) -> B: all-gather the (padded) chunks and drop the padding."""
    full = -(-logical // axis.size)
    piece = _padded(local, dim, full)
    pieces = [torch.empty_like(piece) for _ in range(axis.size)]
    _record("all_gather", axis.mesh_dim, (axis.size - 1) * _nbytes(piece))
    dist.all_gather(pieces, piece, group=axis.group)
    return torch.cat(pieces, dim).narrow(dim, 0, logical).contiguous()


def reduce_partials(local: torch.Tensor, axis: _Axis) -> torch.Tensor:
    """P -> B: all-reduce (sum) the summands."""
    out = local.clone()
    _record("all_reduce", axis.mesh_dim, 2 * (axis.size - 1) / axis.size * _nbytes(out))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=axis.group)
    return out


def reduce_scatter_partials(local: torch.Tensor, dim: int, axis: _Axis) -> torch.Tensor:
    """P -> S(dim): reduce-scatter; each rank receives the sum of its own chunk."""
    size = local.size(dim)
    full = -(-size // axis.size)
    chunks = [_padded(_chunk(local, dim, axis.size, k), dim, full) for k in range(axis.size)]
    out = torch.empty_like(chunks[0])
    _record("reduce_scatter", axis.mesh_dim, (axis.size - 1) * _nbytes(out))
    dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=axis.group)
    start, stop = chunk_bounds(size, axis.size, axis.coord)
    return out.narrow(dim, 0, stop - start).contiguous()


def exchange_shards(local: torch.Tensor, src_dim: int, dst_dim: int,
                    logical: Sequence[int], axis: _Axis) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim): all-to-all; rank k receives piece k of every rank's chunk."""
    n = axis.size
    full_src = -(-logical[src_dim] // n)
    full_dst = -(-logical[dst_dim] // n)
    outgoing = [
        _padded(_padded(_chunk(local, dst_dim, n, k), dst_dim, full_dst), src_dim, full_src)
        for k in range(n)
    ]
    incoming = [torch.empty_like(outgoing[0]) for _ in range(n)]
    _record("all_to_all", axis.mesh_dim, (n - 1) * _nbytes(outgoing[0]))
    dist.all_to_all(incoming, outgoing, group=axis.group)
    # Piece k came from rank k: the rows it owns along src_dim, padding dropped.
    pieces = []
    for k, piece in enumerate(incoming):
        start, stop = chunk_bounds(logical[src_dim], n, k)
        pieces.append(piece.narrow(src_dim, 0, stop - start))
    start, stop = chunk_bounds(logical[dst_dim], n, axis.coord)
    return torch.cat(pieces, src_dim).narrow(dst_dim, 0, stop - start).contiguous()


def take_chunk(local: torch.Tensor, dim: int, axis: _Axis) -> torch.Tensor:
    """B -> S(dim): keep this rank's ``torch.chunk`` piece (a copy, as DTensor makes)."""
    return _chunk(local, dim, axis.size, axis.coord).clone()


def split_into_partials(local: torch.Tensor, axis: _Axis, zero_fill: bool = False) -> torch.Tensor:
    """B -> P: ``x / n`` on every rank (DTensor's choice), or ``x`` on rank 0 and zeros elsewhere."""
    if zero_fill:
        return local.clone() if axis.coord == 0 else torch.zeros_like(local)
    return local / axis.size


def shard_to_partial(local: torch.Tensor, dim: int, logical: Sequence[int], axis: _Axis) -> torch.Tensor:
    """S(dim) -> P: place the chunk in zeros as long as the logical ``dim``."""
    start, _ = chunk_bounds(logical[dim], axis.size, axis.coord)
    shape = list(local.shape)  # other dims may be split by other mesh dims
    shape[dim] = logical[dim]
    out = local.new_zeros(shape)
    out.narrow(dim, start, local.size(dim)).copy_(local)
    return out


def box_one_dim(local: torch.Tensor, src: Placement, dst: Placement,
                logical: Sequence[int], axis: _Axis, zero_fill: bool = False) -> torch.Tensor:
    """Apply :data:`RULES` for one mesh dimension; ``logical`` is the shape this dimension sees."""
    how = rule(src, dst).how
    if how == "nothing" or axis.size == 1:
        return local
    if how == "all_gather":
        return gather_shards(local, src.dim, logical[src.dim], axis)
    if how == "all_reduce":
        return reduce_partials(local, axis)
    if how == "reduce_scatter":
        return reduce_scatter_partials(local, dst.dim, axis)
    if how == "all_to_all":
        return exchange_shards(local, src.dim, dst.dim, logical, axis)
    if how == "local slice":
        return take_chunk(local, dst.dim, axis)
    if how == "local scale":
        return split_into_partials(local, axis, zero_fill)
    if how == "local zero-fill":
        return shard_to_partial(local, src.dim, logical, axis)
    raise AssertionError(how)


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


def _axis(mesh: DeviceMesh, mesh_dim: int) -> _Axis:
    return _Axis(mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), mesh_dim)


def redistribute(local: torch.Tensor, mesh: DeviceMesh, src: Sequence[Placement],
                 dst: Sequence[Placement], shape: Sequence[int], zero_fill: bool = False) -> torch.Tensor:
    """Hand-written ``redistribute`` on local tensors: this rank's piece for ``dst``."""
    coord = mesh.get_coordinate()
    if coord is None:
        return local
    current = list(src)
    for step in plan(src, dst):
        logical = logical_shapes(shape, mesh.shape, current, coord)[step.mesh_dim]
        local = box_one_dim(local, step.src, step.dst, logical, _axis(mesh, step.mesh_dim), zero_fill)
        current[step.mesh_dim] = step.dst
    return local


def redistribute_dtensor(tensor: DTensor, dst: Sequence[Placement]) -> DTensor:
    """:func:`redistribute` on a DTensor: same contract as ``tensor.redistribute(mesh, dst)``."""
    local = redistribute(tensor.to_local(), tensor.device_mesh, tensor.placements, tuple(dst), tensor.shape)
    return DTensor.from_local(local, tensor.device_mesh, tuple(dst), shape=tensor.shape, stride=tensor.stride())


# ---------------------------------------------------------------- tables

_FUNCOL_NAMES = {
    "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
}


def collective_names(comm_counts: dict) -> dict[str, int]:
    """``CommDebugMode.get_comm_counts()`` with our short names (``all_gather`` ...)."""
    names: dict[str, int] = {}
    for op, count in comm_counts.items():
        short = str(op).rsplit(".", 1)[-1]
        short = _FUNCOL_NAMES.get(short, short)
        names[short] = names.get(short, 0) + count
    return names


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
