"""The elastic worker's sharded mode (``--strategy fsdp``): FSDP2 and a DCP checkpoint directory.

:func:`fit_sharded` is the book's training loop (:func:`ddpguide.train.loop.fit`)
with two changes:

* the model is wrapped with ``fully_shard``, each layer and then the root, on a
  1-D mesh of the whole world (:func:`ddpguide.sharding.strategies.apply_fsdp2`):
  every rank keeps only its piece of each parameter and of the optimizer state;
* so no rank holds the whole model, and every rank writes its own pieces into a
  checkpoint directory after each epoch (:func:`ddpguide.sharding.dcp.save_sharded`).
  The directory records the global shape of every tensor, so a group of another
  size reads it back (:func:`~ddpguide.sharding.dcp.load_sharded` reshards:
  saved by 2 ranks, loaded by 4) and continues after the last saved epoch.

It reports the same events as ``fit``, and its ``start`` event adds ``saved_by``:
the world size of the group that wrote the checkpoint it resumed from.

:func:`replay` is the check: one process, no process group, the same epochs at
the same world sizes; the sharded run must end with the same parameters.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ddpguide.core.data import DataSplits, train_loader
from ddpguide.core.models import build_model
from ddpguide.core.ranklog import get_logger
from ddpguide.core.runtime import DistEnv, worker_device
from ddpguide.sharding.dcp import find_checkpoint, load_sharded, save_sharded
from ddpguide.sharding.strategies import apply_fsdp2
from ddpguide.train.loop import EpochRecord, EventHook, TrainConfig, run_steps


@dataclass
class ShardedResult:
    """What :func:`fit_sharded` did on this rank (the same on every rank)."""

    world_size: int
    start_epoch: int
    saved_by: int | None        # world size that wrote the checkpoint this run resumed from
    history: list[dict]         # every epoch done for good, across restarts
    parameters: dict[str, torch.Tensor]  # gathered whole, on the CPU


def fit_sharded(config: TrainConfig, data: DataSplits,
                on_event: EventHook | None = None) -> ShardedResult:
    """Train ``config.model`` sharded with FSDP2 on every rank of the current process group.

    With ``config.checkpoint`` (a directory), resumes after the last saved
    epoch, resharded to this world, and saves after every epoch. Every rank
    calls it. ``on_event`` gets the events of :func:`ddpguide.train.loop.fit`.
    """
    config.validate()
    env = DistEnv.from_environ()
    device = worker_device()
    logger = get_logger()
    emit: EventHook = on_event or (lambda name, **fields: None)
    torch.manual_seed(config.seed)  # the same full model on every rank before it is cut
    model = apply_fsdp2(build_model(config.model).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    criterion = nn.CrossEntropyLoss()

    start_epoch, history, saved_by = 0, [], None
    if config.checkpoint and find_checkpoint(config.checkpoint) is not None:
        extra = load_sharded(model, optimizer, config.checkpoint)
        start_epoch, saved_by = extra["epoch"] + 1, extra["world_size"]
        history = list(extra["history"])
        if config.log and env.is_main:
            logger.info("resumed from %s (saved by %d ranks, loaded by %d): epoch %d done, "
                        "continuing at epoch %d", config.checkpoint, saved_by, env.world_size,
                        start_epoch - 1, start_epoch)

    # DistributedSampler pads every rank's share to the same length, so every
    # rank runs the same number of steps: FSDP's collectives always pair up.
    loader = train_loader(data.train, config.batch_size, env.rank, env.world_size,
                          seed=config.data_seed)
    emit("start", epoch=start_epoch, resumed=start_epoch > 0, world_size=env.world_size,
         saved_by=saved_by)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = criterion(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # reduce-scatter: each rank gets the mean gradient of its piece
        optimizer.step()
        return loss

    stepped = False
    model.train()
    for epoch in range(start_epoch, config.epochs):
        epoch_start = time.perf_counter()
        loader.sampler.set_epoch(epoch)
        loss_sum = run_steps(loader, step, config, device, emit, epoch, env.world_size, stepped)
        stepped = stepped or bool(loss_sum[1] > 0)
        dist.all_reduce(loss_sum)
        record = EpochRecord(epoch, env.world_size, float(loss_sum[0] / loss_sum[1]), None,
                             time.perf_counter() - epoch_start)
        history.append(asdict(record))
        if config.checkpoint:
            # Every rank writes its pieces; it returns once the new directory is in place.
            save_sharded(model, optimizer, config.checkpoint,
                         extra={"epoch": epoch, "history": history,
                                "world_size": env.world_size})
        if config.log and env.is_main:
            logger.info("epoch %d/%d: loss %.4f (%.1f s, world size %d, sharded)", epoch + 1,
                        config.epochs, record.train_loss, record.seconds, env.world_size)
        emit("epoch", epoch=epoch, world_size=env.world_size, loss=record.train_loss,
             seconds=record.seconds)
    parameters = {name: _whole(p) for name, p in model.named_parameters()}
    return ShardedResult(env.world_size, start_epoch, saved_by, history, parameters)


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    """The full tensor of a sharded parameter (an all-gather: every rank calls it)."""
    value = parameter.detach()
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
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    criterion = nn.CrossEntropyLoss()
    for epoch, world in enumerate(world_sizes):
        loaders = [train_loader(data.train, config.batch_size, rank, world, seed=config.data_seed)
                   for rank in range(world)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        for step, batches in enumerate(zip(*loaders)):
            if config.max_steps_per_epoch is not None and step >= config.max_steps_per_epoch:
                break
            loss = sum(criterion(model(x), y) for x, y in batches) / world
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
