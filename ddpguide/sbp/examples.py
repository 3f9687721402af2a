"""The SBP chapter's worked examples, run on every rank through
:func:`ddpguide.sbp.workers.run`: the seed's linear regression as data
parallelism in SBP terms, a tensor-parallel layer, and the one-line errors for
bad input."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ddpguide.sbp import boxing_by_hand
from ddpguide.sbp.placements import (
    B,
    S,
    device_mesh,
    mesh_device,
    mesh_device_type,
    placement,
    sbp_names,
    to_global,
)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy, to return from a rank."""
    return t.detach().to("cpu").clone()


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """The collectives ``mode`` saw, by the book's names."""
    return boxing_by_hand.collective_names(mode.get_comm_counts())

SEED_X = [[1.0, 2.0], [2.0, 3.0], [4.0, 6.0], [3.0, 1.0]]


SEED_Y = [[8.0], [13.0], [26.0], [9.0]]


def linear_regression(iters: int = 500, lr: float = 0.01) -> dict:
    """The seed's regression as SBP: weights B, data S(0); loss = global sum of squares."""
    mesh = device_mesh((dist.get_world_size(),))
    x_all, y_all = torch.tensor(SEED_X), torch.tensor(SEED_Y)
    x, y = to_global(x_all, mesh, S(0)), to_global(y_all, mesh, S(0))
    w = nn.Parameter(to_global(torch.zeros(2, 1), mesh, B))
    optimizer = torch.optim.SGD([w], lr=lr)
    w_ref = torch.zeros(2, 1, requires_grad=True)  # one process, full batch
    optimizer_ref = torch.optim.SGD([w_ref], lr=lr)
    losses, first = [], {}
    for step in range(iters):
        # Watch the collectives of the first step only (the others are the same).
        watch = CommDebugMode if step == 0 else contextlib.nullcontext
        optimizer.zero_grad()
        with watch() as fwd_bwd:
            loss = ((x @ w - y) ** 2).sum()
            loss.backward()
        with watch() as update:
            optimizer.step()
        optimizer_ref.zero_grad()
        ((x_all @ w_ref - y_all) ** 2).sum().backward()
        optimizer_ref.step()
        if step == 0:
            mine = x.to_local().cpu()
            w0 = torch.zeros(2, 1, requires_grad=True)
            ((mine @ w0 - y.to_local().cpu()) ** 2).sum().backward()
            first = {"loss_sbp": sbp_names(loss.placements), "grad_sbp": sbp_names(w.grad.placements),
                     "pred_sbp": sbp_names((x @ w).placements),
                     "grad_local": to_cpu(w.grad.to_local()), "own_shard_grad": to_cpu(w0.grad),
                     "forward_backward_comms": comm_counts(fwd_bwd), "step_comms": comm_counts(update)}
        if (step + 1) % 50 == 0:
            losses.append((step + 1, float(loss.detach().full_tensor())))
    return {"w": to_cpu(w.full_tensor()), "w_local": to_cpu(w.to_local()), "w_sbp": sbp_names(w.placements),
            "w_ref": to_cpu(w_ref), "losses": losses, **first}


def tensor_parallel(seed: int = 0, batch: int = 4) -> dict:
    """An MLP with ColwiseParallel then RowwiseParallel against the same MLP on one process."""
    mesh = device_mesh((dist.get_world_size(),))
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    tp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    tp.load_state_dict(plain.state_dict())
    x = torch.randn(batch, 8)
    plain(x).pow(2).sum().backward()
    tp = parallelize_module(tp.to(mesh_device(mesh)), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with CommDebugMode() as fwd:
        out = tp(x.to(mesh_device(mesh)))
    with CommDebugMode() as bwd:
        out.pow(2).sum().backward()
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    params = dict(tp.named_parameters())
    return {
        "out": to_cpu(out), "expected": to_cpu(plain(x)),
        "param_sbp": {n: sbp_names(params[n].placements) for n in names},
        "local_shapes": {n: tuple(params[n].to_local().shape) for n in names},
        "grads": {n: to_cpu(params[n].grad.full_tensor()) for n in names},
        "expected_grads": {n: to_cpu(p.grad) for n, p in plain.named_parameters()},
        "forward_comms": comm_counts(fwd), "backward_comms": comm_counts(bwd),
    }


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the message is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def invalid_inputs() -> dict:
    """Each mistake through our wrappers (clear message) and through DTensor directly."""
    world = dist.get_world_size()
    mesh = device_mesh((world,))
    t = torch.zeros(5, 4, device=mesh_device(mesh))
    source = distribute_tensor(t, mesh, [Shard(0)]).redistribute(mesh, [Partial()])
    return {
        "split_missing_dim": _error(lambda: to_global(t, mesh, S(2))),
        "split_missing_dim_dtensor": _error(lambda: distribute_tensor(t, mesh, [Shard(2)])),
        "mesh_too_big": _error(lambda: device_mesh((2, world))),
        "mesh_too_big_dtensor": _error(lambda: init_device_mesh(mesh_device_type(), (2, world))),
        "placement_outside": _error(lambda: placement(list(range(world + 2)))),
        "sbp_count": _error(lambda: to_global(t, mesh, (B, S(0)))),
        "partial_kind": _error(lambda: boxing_by_hand.redistribute_dtensor(source, [Partial("max")])),
        "partial_kind_dtensor": _error(lambda: source.redistribute(mesh, [Partial("max")])),
        "world": world,
    }
