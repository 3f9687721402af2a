"""The SBP chapter's worked examples, run on every rank through
:func:`ddpguide.sbp.workers.run`: the source's linear regression as data
parallelism in SBP terms and a tensor-parallel layer (both the code of
``book/programs/dtensor_regression.py``, imported from there with
:func:`ddpguide.launch.programs.load`, afresh on each call, so an edited program is what
the checks run), and the one-line errors for bad input."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from ddpguide.launch import programs
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


#: The chapter's program: its regression and tensor-parallel layer are what is checked here.
PROGRAM = "dtensor_regression.py"


def linear_regression(iters: int = 500, lr: float = 0.01,
                      program: str | os.PathLike = PROGRAM) -> dict:
    """The program's regression (weights B, data S(0), a global sum loss), as plain data."""
    source = programs.load(program)
    mesh = device_mesh((dist.get_world_size(),))
    reg = source.regression(mesh, iters=iters, lr=lr)
    # Rank r's own sample, alone, at w = 0: what its partial gradient must be.
    mine = torch.tensor(source.SEED_X).chunk(dist.get_world_size())[dist.get_rank()]
    y_mine = torch.tensor(source.SEED_Y).chunk(dist.get_world_size())[dist.get_rank()]
    w0 = torch.zeros(2, 1, requires_grad=True)
    ((mine @ w0 - y_mine) ** 2).sum().backward()
    assert w0.grad is not None  # a leaf that requires grad, after its backward
    w = reg["w"]
    return {"w": to_cpu(w.full_tensor()), "w_local": to_cpu(w.to_local()), "w_sbp": sbp_names(w.placements),
            "w_ref": to_cpu(reg["w_ref"]), "losses": reg["losses"],
            "loss_sbp": sbp_names(reg["loss"]), "grad_sbp": sbp_names(reg["grad"]),
            "pred_sbp": sbp_names(reg["pred"]), "grad_local": to_cpu(reg["grad_local"]),
            "own_shard_grad": to_cpu(w0.grad),
            "forward_backward_comms": boxing_by_hand.collective_names(reg["forward_backward"]),
            "step_comms": boxing_by_hand.collective_names(reg["step"])}


def tensor_parallel(seed: int = 0, batch: int = 4, program: str | os.PathLike = PROGRAM) -> dict:
    """The program's tensor-parallel Linear-ReLU-Linear against the plain one, as plain data."""
    mesh = device_mesh((dist.get_world_size(),))
    result = programs.load(program).tensor_parallel(mesh, seed=seed, batch=batch)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    params = dict(result["tp"].named_parameters())
    return {
        "out": to_cpu(result["out"]), "expected": to_cpu(result["expected"]),
        "param_sbp": {n: sbp_names(params[n].placements) for n in names},
        "local_shapes": {n: tuple(params[n].to_local().shape) for n in names},
        "grads": {n: to_cpu(params[n].grad.full_tensor()) for n in names},
        "expected_grads": {n: to_cpu(p.grad) for n, p in result["plain"].named_parameters()},
        "forward_comms": boxing_by_hand.collective_names(result["forward"]),
        "backward_comms": boxing_by_hand.collective_names(result["backward"]),
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
