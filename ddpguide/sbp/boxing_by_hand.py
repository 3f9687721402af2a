"""Boxing by hand: the steps of :mod:`ddpguide.sbp.boxing_rules` as plain ``torch.distributed`` calls.

One function per rule moves this rank's piece along one mesh dimension:
:func:`gather_shards`, :func:`reduce_partials`, :func:`reduce_scatter_partials`
and :func:`exchange_shards` run a collective; :func:`take_chunk`,
:func:`split_into_partials` and :func:`shard_to_partial` stay local.
:func:`box_one_dim` picks one by its rule. Collectives want equal shapes on
every rank, so uneven chunks are padded with zeros and the padding dropped.
:func:`redistribute` carries out a whole :func:`~ddpguide.sbp.boxing_rules.plan`
on local tensors, :func:`redistribute_dtensor` on a DTensor (the contract of
``DTensor.redistribute``). Inside :func:`recording`, each collective is
noted with the bytes this rank sent, to compare with the table of rules;
:func:`collective_names` gives ``CommDebugMode``'s counts the same short names.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from ddpguide.sbp.boxing_rules import plan, rule
from ddpguide.sbp.regions import chunk_bounds, logical_shapes

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


def _dim(placement: Placement) -> int:
    """The tensor dimension of a placement that the rule says is a shard."""
    assert isinstance(placement, Shard), placement
    return placement.dim


def box_one_dim(local: torch.Tensor, src: Placement, dst: Placement,
                logical: Sequence[int], axis: _Axis, zero_fill: bool = False) -> torch.Tensor:
    """Apply the rule for one mesh dimension; ``logical`` is the shape this dimension sees."""
    how = rule(src, dst).how
    if how == "nothing" or axis.size == 1:
        return local
    if how == "all_gather":
        return gather_shards(local, _dim(src), logical[_dim(src)], axis)
    if how == "all_reduce":
        return reduce_partials(local, axis)
    if how == "reduce_scatter":
        return reduce_scatter_partials(local, _dim(dst), axis)
    if how == "all_to_all":
        return exchange_shards(local, _dim(src), _dim(dst), logical, axis)
    if how == "local slice":
        return take_chunk(local, _dim(dst), axis)
    if how == "local scale":
        return split_into_partials(local, axis, zero_fill)
    if how == "local zero-fill":
        return shard_to_partial(local, _dim(src), logical, axis)
    raise AssertionError(how)


# ---------------------------------------------------------------- several mesh dimensions

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

