"""FSDP2 as a strategy of the one training loop: ``fit(config, strategy=FSDP2())``.

:class:`FSDP2` gives :func:`ddpguide.train.loop.fit` two changes, and the loop
stays the same:

* the model is wrapped with ``fully_shard``, each layer and then the root, on a
  1-D mesh of the whole world (:func:`ddpguide.sharding.strategies.apply_fsdp2`):
  every rank keeps only its piece of each parameter and of the optimizer state;
* so no rank holds the whole model, and every rank writes its own pieces into a
  checkpoint directory after each epoch (:func:`ddpguide.sharding.dcp.save_sharded`).
  The directory records the global shape of every tensor, so a group of another
  size reads it back (:func:`~ddpguide.sharding.dcp.load_sharded` reshards:
  saved by 2 ranks, loaded by 4) and continues after the last saved epoch.

The loop's ``start`` event then adds ``saved_by``: the world size of the group
that wrote the checkpoint it resumed from.

:func:`replay` is the check: one process, no process group, the same epochs at
the same world sizes; the sharded run must end with the same parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler

from ddpguide.core.data import DataSplits, train_loader
from ddpguide.core.models import build_model
from ddpguide.core.runtime import DistEnv, Runtime
from ddpguide.sharding.dcp import find_checkpoint, load_sharded, save_sharded
from ddpguide.sharding.strategies import apply_fsdp2
from ddpguide.train.config import TrainConfig
from ddpguide.train.strategy import Resumed, sgd


class FSDP2:
    """Each rank holds a piece of every parameter (``fully_shard``); a DCP directory per save.

    The scaler of mixed precision is not sharded here: fp16 (whose scaler
    would need FSDP's ``ShardedGradScaler``) is refused; off and bf16 work.
    """

    name = "fsdp"
    sharded = True

    def check(self, config: TrainConfig) -> None:
        if config.amp == "fp16":
            raise ValueError("amp 'fp16' needs a sharded gradient scaler: use 'bf16' with FSDP2")
        if config.sync_bn:
            raise ValueError("sync_bn is DDP's: FSDP2 shards the batch-norm layers too")

    def wrap(self, model: nn.Module, env: DistEnv, runtime: Runtime) -> nn.Module:
        return apply_fsdp2(model.to(runtime.device(env.local_rank)))

    def optimizer(self, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
        return sgd(model, lr, momentum)  # over the DTensor pieces: its state is sharded too

    def load(self, path, model, optimizer, scaler, device) -> Resumed | None:
        if find_checkpoint(path) is None:
            return None
        extra = load_sharded(model, optimizer, path)
        return Resumed(extra["epoch"] + 1, list(extra["history"]), extra["world_size"])

    def save(self, path, epoch, model, optimizer, scaler, history, env) -> None:
        # Every rank writes its pieces; it returns once the new directory is in place.
        save_sharded(model, optimizer, path,
                     extra={"epoch": epoch, "history": history, "world_size": env.world_size})

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole tensors, on the CPU (an all-gather per parameter: every rank calls it)."""
        return {name: _whole(value) for name, value in model.state_dict().items()}


def _whole(value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).cpu().clone()


def replay(config: TrainConfig, data: DataSplits, world_sizes: list[int]) -> dict[str, torch.Tensor]:
    """The parameters after epoch ``i`` ran at world size ``world_sizes[i]``, in one process.

    Each step takes every rank's batch (the same samplers, one per simulated
    rank) and averages the ranks' mean losses, which is what FSDP's averaged
    gradients amount to. No checkpoint: an interrupted epoch left nothing
    behind in the sharded run either, so only the finished epochs count.
    """
    torch.manual_seed(config.seed)
    model = build_model(config.model)
    optimizer = sgd(model, config.lr, config.momentum)
    criterion = nn.CrossEntropyLoss()
    for epoch, world in enumerate(world_sizes):
        loaders = [train_loader(data.train, config.batch_size, rank, world, seed=config.data_seed)
                   for rank in range(world)]
        for loader in loaders:
            sampler = loader.sampler
            assert isinstance(sampler, DistributedSampler)
            sampler.set_epoch(epoch)
        for step, batches in enumerate(zip(*loaders)):
            if config.max_steps_per_epoch is not None and step >= config.max_steps_per_epoch:
                break
            loss = sum(criterion(model(x), y) for x, y in batches) / world
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
