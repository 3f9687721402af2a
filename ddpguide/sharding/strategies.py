"""Data parallelism with and without sharding, behind one small interface.

:func:`build` wraps a model for one strategy on the current process group:

============== ==================================================== ===========
name           what each rank keeps between steps                   ZeRO stage
============== ==================================================== ===========
``single``     everything (one process, no communication)            -
``ddp``        everything; gradients all-reduced (``P -> B``)         0
``zero1``      DDP + ``ZeroRedundancyOptimizer``: its share of        1
               Adam's state; whole tensors per rank, broadcast back
``zero2_hand`` full parameters, ``S(0)`` gradients and state           2
``zero3_hand`` ``S(0)`` parameters, gradients and state (by hand)      3
``fsdp2``      ``fully_shard`` per layer and on the root: the same    3
============== ==================================================== ===========

Every strategy trains with Adam and exposes the same three things: ``step``,
``full_state`` (the full parameters, gathered) and ``local_tensors`` (what
this rank holds, for :mod:`ddpguide.sharding.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.core.mesh import device_mesh
from ddpguide.core.runtime import worker_device
from ddpguide.sharding.zero3 import ShardedModel

STRATEGIES = ("single", "ddp", "zero1", "zero2_hand", "zero3_hand", "fsdp2")
ZERO_STAGE = {"single": 0, "ddp": 0, "zero1": 1, "zero2_hand": 2, "zero3_hand": 3, "fsdp2": 3}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_strategy(name: str) -> str:
    """``name`` if it is a known strategy, else a ValueError naming the choices."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")
    return name


@dataclass
class Trainer:
    """A wrapped model, its optimizer and the tensors each rank owns."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sharded: ShardedModel | None = None
    names: list[str] = field(default_factory=list)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn) -> float:
        """One training step on this rank's batch; returns this rank's loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full parameters by name, on the CPU (a collective for sharded strategies)."""
        if self.sharded is not None:
            return {k: v.cpu() for k, v in self.sharded.full_state().items()}
        out = {}
        for name, p in zip(self.names, self.model.parameters()):
            value = p.detach()
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[name] = value.cpu().clone()
        return out

    def local_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's parameter, gradient and optimizer-state tensors (local pieces only)."""
        if self.sharded is not None:
            shards = self.sharded.shards
            # Full (padded) buffers in memory: ZeRO-2 always, ZeRO-3 only inside a step.
            held = [s.full for s in shards if s.gathered]
            # A ZeRO-2 shard is a view into its full buffer: counting both would count it twice.
            params = held if not self.sharded.free_after_use else [s.shard for s in shards] + held
            grads = [t.grad for s in shards for t in (s.shard, s.param) if t.grad is not None]
        else:
            params = list(self.model.parameters())
            grads = [p.grad for p in params if p.grad is not None]
        optimizer = self.optimizer.optim if isinstance(self.optimizer, ZeroRedundancyOptimizer) \
            else self.optimizer
        states = [t for state in optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor)]
        return {"params": [_local(t) for t in params], "grads": [_local(t) for t in grads],
                "optimizer": [_local(t) for t in states]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def layers_with_parameters(model: nn.Module) -> list[nn.Module]:
    """Submodules that own parameters directly: FSDP's units, one per layer."""
    return [m for m in model.modules()
            if m is not model and any(True for _ in m.parameters(recurse=False))]


def apply_fsdp2(model: nn.Module, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """``fully_shard`` on every layer, then on the root (FSDP2's usual pattern)."""
    mesh = device_mesh((dist.get_world_size(),))
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy  # None: fully_shard's default
    for module in [*layers_with_parameters(model), model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def build(name: str, model: nn.Module, lr: float = 1e-2, *, reshard_after_forward: bool = True,
          device: torch.device | str | None = None) -> Trainer:
    """Wrap ``model`` for strategy ``name``, on ``device`` (default: this rank's, where a
    process group runs) unless it is on ``meta``.

    Every rank must pass a model with the same initial values (DDP and ZeRO-1
    check it; the sharded strategies take each rank's piece of its own copy).
    A model on the meta device is materialised sharded (fsdp2, zero3_hand) and
    its values are left uninitialised: for measurements, not for equivalence.
    """
    check_strategy(name)
    names = [n for n, _ in model.named_parameters()]
    if not any(p.is_meta for p in model.parameters()) and (device is not None or dist.is_initialized()):
        model.to(device or worker_device())  # on nccl a host model fails at its first collective
    if name == "single":
        return Trainer(name, model, torch.optim.Adam(model.parameters(), lr=lr), names=names)
    if name in ("ddp", "zero1"):
        wrapped = DDP(model)
        if name == "ddp":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(wrapped.parameters(), lr=lr)
        else:
            optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam,
                                                lr=lr)
        return Trainer(name, wrapped, optimizer, names=names)
    if name == "fsdp2":
        on_meta = any(p.is_meta for p in model.parameters())
        apply_fsdp2(model, reshard_after_forward)
        if on_meta:
            model.to_empty(device=device or worker_device())
        return Trainer(name, model, torch.optim.Adam(model.parameters(), lr=lr), names=names)
    sharded = ShardedModel(model, free_after_use=(name == "zero3_hand"), device=device)
    return Trainer(name, model, torch.optim.Adam(sharded.parameters(), lr=lr), sharded, names)


def on_rank_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on this rank's device (:func:`worker_device`) where a process group runs."""
    if not dist.is_initialized():
        return tensors
    device = worker_device()
    return tuple(t.to(device) for t in tensors)
