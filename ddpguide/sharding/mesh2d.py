"""Two-dimensional meshes: FSDP2 x tensor parallelism, and HSDP, checked against one process.

On a ``(2, 2)`` mesh named ``("dp", "tp")`` every MLP is split by tensor
parallelism within a row (``mesh["tp"]``) and FSDP2 shards the pieces again
within a column (``mesh["dp"]``); each ``dp`` index reads its share of the
batch. HSDP is ``fully_shard`` given the whole 2-D mesh: parameters sharded
along the second dimension and replicated along the first, with every rank
reading its own share of the batch.

The workers import the chapter's program (``book/programs/fsdp_tp_2d.py``) and
use its model, its two layouts and its SGD loop, in float64, then compare losses
and weights with one process training the same model on the whole batch.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ddpguide.core.mesh import device_mesh, mesh_device
from ddpguide.launch import programs

#: The chapter's program: its model, its layouts and its training loop are what is checked.
PROGRAM = "fsdp_tp_2d.py"


def check_mesh_shape(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The shape as a tuple; ``ValueError`` unless its sizes are positive and multiply to the world."""
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} needs at least one dimension, all of size >= 1")
    if math.prod(shape) != world_size:
        raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} ranks, "
                         f"but the world size is {world_size}")
    return shape


def mesh_2d(shape: Sequence[int] = (2, 2), names: Sequence[str] = ("dp", "tp")) -> DeviceMesh:
    """A named mesh over every rank, its process groups with the default group's timeout."""
    shape = check_mesh_shape(shape, dist.get_world_size())
    if len(names) != len(shape):
        raise ValueError(f"mesh names {tuple(names)} do not match mesh shape {shape}")
    return device_mesh(shape, names)


def quiet_warnings() -> None:
    """Silence two warnings about what these workers do on purpose."""
    # FSDP2 warns that a layer returns a view (Stack adds it out of place, which is safe),
    # and DTensor that full_tensor() of a 2-D sharded weight takes two all-gathers.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _compare(source, model: nn.Module, losses: list[float], x: torch.Tensor,
             y: torch.Tensor, seed: int) -> dict:
    """Train the program's plain model on the whole batch here (one process) and compare."""
    torch.manual_seed(seed)
    plain = source.Model().to(x.device, torch.float64)
    plain_losses = source.train(plain, x, y)
    plain_params = dict(plain.named_parameters())
    differences = [abs(a - b) for a, b in zip(losses, plain_losses)]
    rows, held = [], None
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name  # the layout made every parameter a DTensor
        full, local = p.full_tensor(), p.to_local()
        differences.append((full - plain_params[name]).abs().max().item())
        rows.append({"parameter": name, "placements": str(tuple(p.placements)),
                     "local shape": tuple(local.shape), "global shape": tuple(p.shape)})
        if held is None:  # which contiguous rows of the first weight this rank holds
            start = next(r for r in range(full.shape[0]) if torch.equal(full[r], local[0]))
            if torch.equal(full[start:start + local.shape[0]], local):
                held = (name, start, start + local.shape[0])
    worst = torch.tensor(max(differences), dtype=torch.float64, device=x.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"losses": losses, "one_process_losses": plain_losses,
            "max_difference": worst.item(), "parameters": rows, "rows_held": held}


def _train_and_compare(program: str, mesh: DeviceMesh, layout: str, share: int, shares: int,
                       group, seed: int) -> dict:
    """The program's model laid out by its function ``layout``, trained by its ``train`` on
    share ``share`` of ``shares`` of its data; then compared with one process."""
    quiet_warnings()
    source = programs.load(program)
    device = mesh_device(mesh)
    x, y = source.data(device.type)
    torch.manual_seed(seed)
    model = getattr(source, layout)(source.Model().to(device, torch.float64), mesh)
    losses = source.train(model, x.chunk(shares)[share], y.chunk(shares)[share], group, shares)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # None only for a rank outside the mesh
    return {"mesh": mesh.mesh.tolist(), "coordinate": tuple(coordinate),
            "steps": source.STEPS, **_compare(source, model, losses, x, y, seed)}


def fsdp_tp(program: str = PROGRAM, seed: int = 0) -> dict:
    """Worker (4 ranks): the program's TP over ``mesh["tp"]``, FSDP2 over ``mesh["dp"]``, vs one process."""
    mesh = mesh_2d((2, 2), ("dp", "tp"))
    dp = mesh["dp"]  # the two ranks of a tp row read the same share
    return _train_and_compare(program, mesh, "shard_fsdp_x_tp", dp.get_local_rank(), dp.size(),
                              dp.get_group(), seed)


def hsdp(program: str = PROGRAM, seed: int = 0) -> dict:
    """Worker (4 ranks): the program's ``fully_shard`` on a (replicate, shard) mesh, vs one process."""
    mesh = mesh_2d((2, 2), ("replicate", "shard"))
    # every rank is data-parallel here
    return _train_and_compare(program, mesh, "shard_hsdp", dist.get_rank(),
                              dist.get_world_size(), None, seed)
