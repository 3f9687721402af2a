"""SBP vocabulary (split, broadcast, partial) spoken on PyTorch's DTensor.

OneFlow describes how a *global* (logical) tensor lives on a cluster with two
things: a *placement* (which devices, arranged as a 1D or 2D array) and an
*SBP* per array dimension. PyTorch's DTensor has the same ideas under other
names, and this module is the dictionary between them:

==================  ==========================  =============================
OneFlow             DTensor                     what each rank holds
==================  ==========================  =============================
``split(i)``        ``Shard(i)``                a ``torch.chunk`` piece along tensor dim ``i``
``broadcast``       ``Replicate()``             the whole tensor
``partial_sum``     ``Partial("sum")``          a summand; the tensor is the sum over ranks
``placement``       ``DeviceMesh``              the device array
``x.to_global``     ``distribute_tensor``       (global view in, local piece out)
``x.to_local``      ``DTensor.to_local``        this rank's piece
==================  ==========================  =============================

Who holds which block of the logical tensor, computed without any process
group, is in :mod:`ddpguide.sbp.regions`.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import Placement

from ddpguide.core import mesh as core_mesh
from ddpguide.core.mesh import mesh_device, mesh_device_type  # noqa: F401 (re-exported)

SBPLike = Placement | str | Sequence[Placement | str]


class SBPError(ValueError):
    """A placement or SBP does not fit the tensor or the cluster."""


# The source's vocabulary, as DTensor placements.
B = broadcast = Replicate()
P = partial_sum = Partial("sum")


def S(dim: int) -> Shard:
    """``split(dim)``: each rank holds a ``torch.chunk`` piece along ``dim``."""
    return Shard(dim)


split = S


def sbp_name(placement: Placement) -> str:
    """The short SBP name of one placement: ``B``, ``S(0)``, ``P`` (or ``P(max)``)."""
    if isinstance(placement, Replicate):
        return "B"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"
    return str(placement)


def sbp_names(placements: Iterable[Placement]) -> str:
    """``(B, S(0))`` for a tuple of placements, ``S(0)`` for a single one."""
    names = [sbp_name(p) for p in placements]
    return names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"


_SPLIT = re.compile(r"^(?:s|split|shard)\((-?\d+)\)$")
_PARTIAL = re.compile(r"^(?:p|partial)(?:\((\w+)\))?$")


def parse_sbp(text: str) -> Placement:
    """Read ``"B"``, ``"S(1)"``, ``"P"``, ``"split(0)"``, ``"broadcast"``, ``"P(max)"`` ..."""
    key = text.strip().lower().replace(" ", "")
    if key in ("b", "broadcast", "r", "replicate", "replicate()"):
        return Replicate()
    if match := _SPLIT.match(key):
        return Shard(int(match.group(1)))
    if match := _PARTIAL.match(key):
        op = match.group(1) or "sum"
        if op == "partial_sum":
            op = "sum"
        return Partial(op)
    raise SBPError(f"unknown SBP {text!r}: use B, S(dim) or P")


def as_placements(sbp: SBPLike, mesh_ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dimension, from a placement, a name, or a tuple of them."""
    items = [sbp] if isinstance(sbp, (Placement, str)) else list(sbp)
    placements = tuple(parse_sbp(p) if isinstance(p, str) else p for p in items)
    if len(placements) != mesh_ndim:
        raise SBPError(
            f"a {mesh_ndim}D placement needs {mesh_ndim} SBP "
            f"entr{'y' if mesh_ndim == 1 else 'ies'} (one per mesh dimension), "
            f"got {len(placements)}: {sbp_names(placements) if placements else '()'}"
        )
    return placements


def check_sbp(shape: Sequence[int], placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Reject a split on a dimension the tensor lacks; normalise negative split dims."""
    ndim = len(shape)
    checked = []
    for placement in placements:
        if isinstance(placement, Shard):
            dim = placement.dim
            if not -ndim <= dim < ndim:
                raise SBPError(
                    f"S({dim}) splits tensor dimension {dim}, but the tensor has shape "
                    f"{tuple(shape)} ({ndim} dimension{'s' if ndim != 1 else ''})"
                )
            placement = Shard(dim % ndim)
        checked.append(placement)
    return tuple(checked)


# ---------------------------------------------------------------- the cluster side

def _require_world() -> int:
    if not dist.is_initialized():
        raise SBPError(
            "no process group: run inside ddpguide.launch.spawn or torchrun "
            "(a placement names ranks of a running job)"
        )
    return dist.get_world_size()


def device_mesh(mesh_shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """:func:`ddpguide.core.mesh.device_mesh` (timeouts on every dimension), its errors as :class:`SBPError`."""
    _require_world()
    try:
        return core_mesh.device_mesh(mesh_shape, names)
    except ValueError as exc:
        raise SBPError(str(exc)) from None


def placement(ranks: Sequence, names: Sequence[str] | None = None) -> DeviceMesh:
    """OneFlow's ``flow.placement(device, ranks)``: ``[0, 1, 2, 3]`` or ``[[0, 1], [2, 3]]``.

    Every rank of the job must call it with the same ``ranks``.
    """
    world = _require_world()
    grid = torch.as_tensor(ranks, dtype=torch.int64)
    flat = grid.flatten().tolist()
    outside = [r for r in flat if not 0 <= r < world]
    if outside:
        raise SBPError(
            f"placement ranks {grid.tolist()} include rank {outside[0]}, but the world has "
            f"only {world} ranks (0-{world - 1})"
        )
    if len(set(flat)) != len(flat):
        raise SBPError(f"placement ranks {grid.tolist()} name a rank twice")
    return DeviceMesh(
        mesh_device_type(), grid,
        mesh_dim_names=tuple(names) if names else None,
        backend_override=core_mesh.subgroup_backends(grid.dim()),
    )


def to_global(tensor: torch.Tensor, mesh: DeviceMesh, sbp: SBPLike) -> DTensor:
    """Global view in: ``tensor`` is the *logical* tensor (rank 0's copy is the truth).

    Like ``distribute_tensor``: rank 0's data is scattered/broadcast so every
    rank ends up with its piece; ``P`` pieces sum to the logical tensor.
    """
    placements = check_sbp(tensor.shape, as_placements(sbp, mesh.ndim))
    return distribute_tensor(tensor.to(mesh_device(mesh)), mesh, placements)


def from_local(local: torch.Tensor, mesh: DeviceMesh, sbp: SBPLike,
               shape: Sequence[int] | None = None) -> DTensor:
    """Local view in: ``local`` *is* this rank's piece (OneFlow's ``to_global`` on a local tensor).

    No communication. Pass ``shape`` (the logical shape) when pieces are uneven.
    """
    placements = as_placements(sbp, mesh.ndim)
    if shape is not None:
        placements = check_sbp(shape, placements)
        stride = torch.empty(tuple(shape), device="meta").stride()
        return DTensor.from_local(local, mesh, placements, shape=torch.Size(shape), stride=stride)
    return DTensor.from_local(local, mesh, check_sbp(local.shape, placements))


def to_local(tensor: DTensor) -> torch.Tensor:
    """This rank's piece of a global tensor."""
    return tensor.to_local()


def broadcast_module(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``module.to_global(placement, sbp=broadcast)``: every parameter replicated on ``mesh``."""
    return distribute_module(module, mesh)


# ---------------------------------------------------------------- who holds what (pure)


