"""Two-dimensional meshes: FSDP2 x tensor parallelism, and HSDP, checked against one process.

On a ``(2, 2)`` mesh named ``("dp", "tp")`` every MLP is split by tensor
parallelism within a row (``mesh["tp"]``) and FSDP2 shards the pieces again
within a column (``mesh["dp"]``); each ``dp`` index reads its share of the
batch. HSDP is ``fully_shard`` given the whole 2-D mesh: parameters sharded
along the second dimension and replicated along the first, with every rank
reading its own share of the batch.

The workers train a few SGD steps in float64 and compare losses and weights
with one process training the same model on the whole batch.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ddpguide.sbp.placements import device_mesh, mesh_device
from ddpguide.sharding.tensor_parallel import MLP, mlp_plan, parallelize

DIM, HIDDEN, LAYERS, BATCH = 8, 32, 2, 8


class Stack(nn.Module):
    """Residual MLP layers: ``x + mlp(x)``, ``LAYERS`` times."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


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


def _data(device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64)
    return x.to(device), torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64).to(device)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
           group=None, shares: int = 1) -> list[float]:
    """SGD on (x, y); the loss recorded is the mean of the ``shares`` ranks' mean losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if shares > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / shares)
    return losses


def _compare(model: nn.Module, losses: list[float], x: torch.Tensor, y: torch.Tensor,
             steps: int, lr: float, seed: int) -> dict:
    """Train the plain model on the whole batch here (one process) and compare."""
    torch.manual_seed(seed)
    plain = Stack().to(x.device, torch.float64)
    plain_losses = _train(plain, x, y, steps, lr)
    plain_params = dict(plain.named_parameters())
    differences = [abs(a - b) for a, b in zip(losses, plain_losses)]
    rows, held = [], None
    for name, p in model.named_parameters():
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


def _train_and_compare(mesh: DeviceMesh, shard: Callable[[nn.Module], None],
                       share: int, shares: int, group, steps: int, lr: float, seed: int) -> dict:
    """Build the model, lay it out with ``shard``, train on share ``share`` of ``shares``."""
    quiet_warnings()
    device = mesh_device(mesh)
    x, y = _data(device, seed)
    torch.manual_seed(seed)
    model = Stack().to(device, torch.float64)
    shard(model)
    losses = _train(model, x.chunk(shares)[share], y.chunk(shares)[share], steps, lr, group, shares)
    return {"mesh": mesh.mesh.tolist(), "coordinate": tuple(mesh.get_coordinate()),
            **_compare(model, losses, x, y, steps, lr, seed)}


def fsdp_tp(steps: int = 3, lr: float = 0.1, seed: int = 0) -> dict:
    """Worker (4 ranks): TP over ``mesh["tp"]``, FSDP2 over ``mesh["dp"]``, vs one process."""
    mesh = mesh_2d((2, 2), ("dp", "tp"))

    def shard(model: nn.Module) -> None:
        for layer in model.layers:
            parallelize(layer, mesh["tp"], mlp_plan())  # first split by TP, then shard by FSDP
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])

    dp = mesh["dp"]  # the two ranks of a tp row read the same share
    return _train_and_compare(mesh, shard, dp.get_local_rank(), dp.size(), dp.get_group(),
                              steps, lr, seed)


def hsdp(steps: int = 3, lr: float = 0.1, seed: int = 0) -> dict:
    """Worker (4 ranks): ``fully_shard`` on a (replicate, shard) mesh, vs one process."""
    mesh = mesh_2d((2, 2), ("replicate", "shard"))

    def shard(model: nn.Module) -> None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    # every rank is data-parallel here
    return _train_and_compare(mesh, shard, dist.get_rank(), dist.get_world_size(), None,
                              steps, lr, seed)
