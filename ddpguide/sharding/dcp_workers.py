"""Workers that save a sharded model with N ranks and load it with M (``ddpguide.sharding.dcp``).

A save returns every model and optimizer tensor gathered whole; a load in
another world returns the same after loading. Comparing the two with
``torch.equal`` proves the reshard exact. The checkpoint stores global tensors,
so it loads into any layout of the same model (:data:`LAYOUTS`): FSDP2 over all
ranks, tensor parallelism over all ranks, the 2x2 FSDP x TP mesh, or a plain
model in one process (no spawn, no process group).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddpguide.core.mesh import device_mesh, mesh_device
from ddpguide.launch import programs
from ddpguide.sharding.dcp import load_sharded, save_sharded
from ddpguide.sharding.mesh2d import mesh_2d, quiet_warnings
from ddpguide.sharding.tensor_parallel import parallelize

#: The chapter's checkpoint program: its model is the one saved and loaded here.
PROGRAM = "dcp_reshard.py"
#: The tensor-parallel program: the ``tp`` layouts split each layer by its MLP plan.
TP_PROGRAM = "tensor_parallel.py"
BATCH = 12


LAYOUTS = ("plain", "tp", "fsdp", "fsdp_tp")


def model_of_program(extra_hidden: int = 0) -> nn.Module:
    """The checkpoint program's ``Model`` (``book/programs/dcp_reshard.py``), built afresh.

    ``extra_hidden`` widens its hidden layers: another model, whose checkpoint must not load.
    """
    source = programs.load(PROGRAM)
    vars(source)["HIDDEN"] += extra_hidden  # this fresh module's own constant: the file is untouched
    return source.Model()


def _layers(model: nn.Module) -> nn.ModuleList:
    """The program's ``Model.layers``."""
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    return layers


def _first_up(model: nn.Module) -> nn.Linear:
    """The program's ``layers[0].up`` (a Linear, also once sharded)."""
    up = model.get_submodule("layers.0.up")
    assert isinstance(up, nn.Linear)
    return up


def sharded_model(seed: int, layout: str = "fsdp",
                  extra_hidden: int = 0) -> tuple[nn.Module, Any, tuple[int, int]]:
    """The program's model in float32 laid out over every rank, Adam over its parameters, and
    this rank's data share as ``(index, count)`` (the ranks of a TP group read the same share).

    Layouts: ``plain`` (one process, no process group), ``tp`` (tensor parallelism over all
    ranks), ``fsdp`` (FSDP2 over all ranks), ``fsdp_tp`` (the 2x2 mesh, 4 ranks).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    quiet_warnings()
    dp_mesh = tp_mesh = None
    device = torch.device("cpu")
    if layout in ("tp", "fsdp"):
        mesh = device_mesh((dist.get_world_size(),))
        dp_mesh, tp_mesh = (None, mesh) if layout == "tp" else (mesh, None)
        device = mesh_device(mesh)
    elif layout == "fsdp_tp":
        mesh = mesh_2d((2, 2), ("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        device = mesh_device(mesh)
    torch.manual_seed(seed)
    model = model_of_program(extra_hidden).to(device)
    for layer in _layers(model):
        if tp_mesh is not None:
            parallelize(layer, tp_mesh, programs.load(TP_PROGRAM).cases()["mlp"][2])
        if dp_mesh is not None:
            fully_shard(layer, mesh=dp_mesh)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh)
    share = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), share


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree.detach().cpu().clone()}
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else \
        enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def full_tensors(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, gathered whole on every rank, by flat name."""
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True))
    return _flatten({"model": model_state, "optim": optim_state})


def _pieces(model: nn.Module) -> dict[str, Any]:
    """What this rank holds of the first weight."""
    weight = _first_up(model).weight
    if not isinstance(weight, DTensor):
        return {"placements": "plain tensor", "local shape": tuple(weight.shape)}
    return {"placements": str(tuple(weight.placements)),
            "local shape": tuple(weight.to_local().shape)}


def train_and_save(directory: str, layout: str = "fsdp", steps: int = 2, seed: int = 0) -> dict:
    """Worker: train ``steps`` Adam steps on this rank's share, then :func:`save_sharded`."""
    model, optimizer, (share, shares) = sharded_model(seed, layout)
    gen = torch.Generator().manual_seed(seed + 1)
    device = next(model.parameters()).device
    # Shares by data-parallel index: the ranks of a tensor-parallel group must read the
    # same batch (ColwiseParallel takes each rank's input to be the same replicated tensor).
    dim = _first_up(model).in_features
    x, y = (torch.randn(BATCH, dim, generator=gen).to(device).chunk(shares)[share] for _ in range(2))
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    world = dist.get_world_size() if dist.is_initialized() else 1
    save_sharded(model, optimizer, directory, extra={"step": steps, "saved_by": world})
    return {"tensors": full_tensors(model, optimizer), "pieces": _pieces(model),
            "files": sorted(os.listdir(directory))}


def load_and_gather(directory: str, layout: str = "fsdp", seed: int = 123) -> dict:
    """Worker: a model with other weights, :func:`load_sharded`, then every tensor gathered."""
    model, optimizer, _ = sharded_model(seed, layout)
    before = full_tensors(model, optimizer)
    extra = load_sharded(model, optimizer, directory)
    return {"tensors": full_tensors(model, optimizer), "before": before, "extra": extra,
            "pieces": _pieces(model)}


def load_another_model(directory: str, extra_hidden: int = 4) -> dict:
    """Worker: load into a model of another size; returns the error and whether weights changed."""
    model, optimizer, _ = sharded_model(0, "fsdp", extra_hidden)
    before = full_tensors(model, optimizer)
    try:
        load_sharded(model, optimizer, directory)
        error = ("no error", "")
    except Exception as exc:  # the message is the result
        error = (type(exc).__name__, str(exc))
    after = full_tensors(model, optimizer)
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged}


def compare(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Which tensors match exactly (``torch.equal``), and which are missing on either side."""
    same = [k for k in saved if k in loaded and torch.equal(saved[k], loaded[k])]
    return {"compared": len(saved), "identical": len(same),
            "different": [k for k in saved if k in loaded and k not in same],
            "missing": sorted(saved.keys() ^ loaded.keys())}
