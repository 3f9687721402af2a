"""How the one training loop is parallelised: a strategy object, handed to :func:`~ddpguide.train.loop.fit`.

The loop (:func:`ddpguide.train.loop.fit`) never names a parallelism. It asks
its strategy for four things:

* :meth:`Strategy.wrap`: the model this rank trains (DDP around the whole
  model, or FSDP2's ``fully_shard`` on every layer, ...);
* :meth:`Strategy.optimizer`: the optimizer over what :meth:`wrap` returned;
* :meth:`Strategy.save` and :meth:`Strategy.load`: the training state after an
  epoch, and back (one file written by rank 0, or every rank's shards in a
  directory); ``load`` returns a :class:`Resumed`, or None when there is
  nothing to resume;
* :meth:`Strategy.check`: refuse, before anything starts, an option it cannot train;
* :attr:`Strategy.sharded`: whether each rank holds only a piece of the state.
  Then every rank must run the same forward passes (each one gathers
  parameters), so evaluation runs the whole test set on every rank, and
  :meth:`Strategy.full_state` is a collective.

What the loop does the same for every strategy: resume after the last saved
epoch; skip the save (and the history) of an epoch in which no rank took a
step; wait at a barrier after every save; report the same events. A new
parallelism (tensor, pipeline, context, expert, or a composition) is a new
strategy, never a new loop.

:class:`DDP` is the default: the chapter 1 loop, with the checkpoint of
:mod:`ddpguide.core.checkpoint`. FSDP2 with a DCP directory is
:class:`ddpguide.sharding.fsdp_strategy.FSDP2`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpguide.core.checkpoint import (
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
    unwrap,
)
from ddpguide.core.runtime import DistEnv, Runtime


@dataclass
class Resumed:
    """What a strategy's :meth:`~Strategy.load` found: where to continue, and the past."""

    start_epoch: int                    # the first epoch still to run
    history: list[dict[str, Any]] = field(default_factory=list)
    saved_by: int | None = None         # the world size of the group that saved it


class Strategy(Protocol):
    """The parallelism of one training run (see the module docstring)."""

    name: str
    sharded: bool

    def check(self, config: Any) -> None:
        """Raise ValueError for an option of ``config`` (a TrainConfig) this strategy cannot train."""

    def wrap(self, model: nn.Module, env: DistEnv, runtime: Runtime) -> nn.Module: ...

    def optimizer(self, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer: ...

    def load(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, device: torch.device) -> Resumed | None: ...

    def save(self, path: str, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, history: list[dict[str, Any]], env: DistEnv) -> None: ...

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]: ...


def sgd(model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    """The book's optimizer: SGD with momentum over every parameter of ``model``."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


class DDP:
    """Every rank holds the whole model; gradients are all-reduced (``DistributedDataParallel``).

    Without a process group the model is not wrapped (one process trains
    alone). Rank 0 saves one checkpoint file (:func:`~ddpguide.core.checkpoint.save_checkpoint`:
    atomic, the previous one kept as the fallback); every rank loads it.
    """

    name = "ddp"
    sharded = False

    def check(self, config: Any) -> None:
        pass  # every option of TrainConfig was written for DDP

    def wrap(self, model: nn.Module, env: DistEnv, runtime: Runtime) -> nn.Module:
        model = model.to(runtime.device(env.local_rank))
        if not (dist.is_available() and dist.is_initialized()):
            return model
        device_ids = [runtime.device(env.local_rank).index] if runtime.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def optimizer(self, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
        return sgd(model, lr, momentum)

    def load(self, path, model, optimizer, scaler, device) -> Resumed | None:
        state = load_checkpoint(path, map_location=device)
        if state is None:
            return None
        start = restore_training_state(state, model, optimizer, scaler)
        return Resumed(start, list(state.get("history", [])), state.get("world_size"))

    def save(self, path, epoch, model, optimizer, scaler, history, env) -> None:
        if env.is_main:  # every rank holds the same state: one writer, no race
            save_checkpoint(training_state(epoch, model, optimizer, scaler, history=history,
                                           world_size=env.world_size), path)

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
