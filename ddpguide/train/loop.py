"""The one training loop of the book.

Chapter 1 meets it under ``mp.spawn``; later chapters reuse it unchanged apart
from options (:class:`TrainConfig`: where rank information comes from, mixed
precision, synchronised batch norm, a checkpoint to resume from) and from its
parallelism, a strategy object (:mod:`ddpguide.train.strategy`: DDP by default,
FSDP2 in :mod:`ddpguide.sharding.fsdp_strategy`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from ddpguide.core.data import DataSplits, eval_loader, load_dataset, train_loader
from ddpguide.core.models import build_model
from ddpguide.core.ranklog import get_logger, progress
from ddpguide.core.runtime import DistEnv, Runtime, select_runtime
from ddpguide.train import amp as amp_mod
from ddpguide.train.config import TrainConfig
from ddpguide.train.strategy import DDP, Resumed, Strategy


@dataclass
class EpochRecord:
    """What one epoch did, as every rank agrees on it."""

    epoch: int
    world_size: int
    train_loss: float
    test_accuracy: float | None
    seconds: float


@dataclass
class TrainResult:
    """The outcome of :func:`fit` on one rank (identical on every rank but ``step_losses``)."""

    dataset: str
    world_size: int
    rank: int
    start_epoch: int
    saved_by: int | None = None  # world size of the group whose checkpoint this run resumed
    epochs: list[EpochRecord] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    test_correct: int = 0
    test_total: int = 0
    seconds: float = 0.0
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    # Every epoch that is done for good, across restarts: carried in the checkpoint.
    history: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.test_correct / self.test_total if self.test_total else float("nan")

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("parameters")
        out.pop("step_losses")
        return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def prepare_model(config: TrainConfig, env: DistEnv, runtime: Runtime,
                  strategy: Strategy | None = None, **model_kwargs) -> nn.Module:
    """Build the model with the same seed on every rank, convert BN, let the strategy wrap it."""
    torch.manual_seed(config.seed)  # the same full model on every rank before any wrapping
    model = build_model(config.model, **model_kwargs)
    if config.sync_bn and _distributed():
        from ddpguide.train.syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, runtime.device_type)
    return (strategy or DDP()).wrap(model, env, runtime)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int, env: DistEnv, device: torch.device,
             settings: amp_mod.AmpSettings | None = None, *, whole: bool = False) -> tuple[int, int]:
    """Correct predictions and samples seen, summed over all ranks, each sample counted once.

    Every rank must call this (it ends in a collective): calling it on rank 0
    only leaves rank 0 waiting for partners that never come. With ``whole``
    (a sharded model, whose every forward is a collective), every rank runs
    the whole test set, the same batches in the same order, and counts it once.
    """
    settings = settings or amp_mod.AmpSettings(device.type, None)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    rank, world = (0, 1) if whole else (env.rank, env.world_size)
    for images, labels in eval_loader(dataset, batch_size, rank, world):
        images, labels = images.to(device), labels.to(device)
        with amp_mod.autocast(settings):
            logits = model(images)
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += labels.numel()
    if _distributed() and not whole:
        dist.all_reduce(counts)
    model.train()
    return int(counts[0]), int(counts[1])


EventHook = Callable[..., None]


def run_steps(batches, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              config: TrainConfig, device: torch.device, emit: EventHook, epoch: int,
              world_size: int, stepped: bool) -> torch.Tensor:
    """One epoch of ``step(inputs, labels) -> loss``; returns this rank's ``[loss sum, steps]``.

    Moves each batch to ``device``, stops after ``config.max_steps_per_epoch``,
    sleeps ``config.step_delay_s`` after each step, and emits ``"first_step"``
    on the first step of the process (``stepped``: whether an earlier epoch took one).
    """
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
    for index, (inputs, labels) in enumerate(batches):
        if config.max_steps_per_epoch is not None and index >= config.max_steps_per_epoch:
            break
        loss = step(inputs.to(device), labels.to(device))
        loss_sum[0] += loss.detach().double()
        loss_sum[1] += 1
        if not stepped:
            stepped = True
            emit("first_step", epoch=epoch, world_size=world_size)
        if config.step_delay_s:
            time.sleep(config.step_delay_s)
    return loss_sum


def fit(config: TrainConfig, env: DistEnv | None = None, runtime: Runtime | None = None, *,
        data: DataSplits | None = None, on_event: EventHook | None = None,
        strategy: Strategy | None = None) -> TrainResult:
    """Train (and evaluate) with ``config`` on this rank; every rank calls it.

    ``strategy`` (default :class:`~ddpguide.train.strategy.DDP`) wraps the model,
    builds its optimizer, saves and loads the state. Without a process group
    one process trains alone. With ``config.checkpoint``, resumes after the
    last saved epoch and saves after every epoch that took a step.

    ``data`` replaces ``load_dataset(config.dataset)`` (e.g. the elastic
    chapter's small synthetic set). ``on_event(name, **fields)`` is called on
    every rank at ``"start"`` (``epoch`` = first epoch to run, ``resumed``; a
    sharded strategy adds ``saved_by``), ``"first_step"`` (the first optimizer
    step of this process) and ``"epoch"`` (at the end of every epoch, once its
    checkpoint, if any, is on disk: ``epoch``, ``loss``, ``seconds``). The
    checkpoint also carries the history of finished epochs
    (``TrainResult.history``) across restarts.
    """
    strategy = strategy or DDP()
    strategy.check(config.validate())
    env = env or (DistEnv.from_environ() if _distributed() else DistEnv.single())
    runtime = runtime or select_runtime(env.local_world_size)
    device = runtime.device(env.local_rank)
    settings = amp_mod.resolve_amp(config.amp, runtime.device_type)
    data = data if data is not None else load_dataset(config.dataset)
    emit: EventHook = on_event or (lambda name, **fields: None)
    model = prepare_model(config, env, runtime, strategy)
    optimizer = strategy.optimizer(model, config.lr, config.momentum)
    scaler = amp_mod.make_scaler(settings)
    criterion = nn.CrossEntropyLoss()

    resumed = _resume(config, strategy, env, model, optimizer, scaler, device)
    # The sampler shards by the *current* world size: after a resize every
    # rank gets its new share of the same shuffled epoch. It pads every share
    # to the same length, so every rank runs the same number of steps (a
    # sharded model's collectives always pair up).
    loader = train_loader(data.train, config.batch_size, env.rank, env.world_size,
                          seed=config.data_seed)
    result = TrainResult(data.name, env.world_size, env.rank, resumed.start_epoch,
                         resumed.saved_by, history=resumed.history)
    emit("start", epoch=resumed.start_epoch, resumed=resumed.start_epoch > 0,
         world_size=env.world_size, **({"saved_by": resumed.saved_by} if strategy.sharded else {}))
    started = time.perf_counter()

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with amp_mod.autocast(settings):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        result.step_losses.append(loss.item())
        return loss

    stepped = False
    model.train()
    for epoch in range(resumed.start_epoch, config.epochs):
        epoch_start = time.perf_counter()
        sampler = loader.sampler
        assert isinstance(sampler, DistributedSampler)  # train_loader's
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        batches = progress(loader, config.progress, desc=f"epoch {epoch}")
        loss_sum = run_steps(batches, step, config, device, emit, epoch, env.world_size, stepped)
        stepped = stepped or bool(loss_sum[1] > 0)
        if _distributed():
            dist.all_reduce(loss_sum)
        accuracy = None
        if config.evaluate:
            correct, total = evaluate(model, data.test, 256, env, device, settings,
                                      whole=strategy.sharded)
            accuracy = correct / total
            result.test_correct, result.test_total = correct, total
        record = EpochRecord(epoch, env.world_size, float(loss_sum[0] / loss_sum[1].clamp(min=1)),
                             accuracy, time.perf_counter() - epoch_start)
        result.epochs.append(record)
        _end_epoch(config, strategy, env, record, bool(loss_sum[1] > 0), result.history,
                   model, optimizer, scaler)
        emit("epoch", epoch=epoch, world_size=env.world_size, loss=record.train_loss,
             seconds=record.seconds)
    result.seconds = time.perf_counter() - started
    result.parameters = strategy.full_state(model)
    return result


def _resume(config: TrainConfig, strategy: Strategy, env: DistEnv, model: nn.Module,
            optimizer: torch.optim.Optimizer, scaler, device: torch.device) -> Resumed:
    """Where this run starts: after the checkpoint's last epoch, or at epoch 0."""
    found = strategy.load(config.checkpoint, model, optimizer, scaler, device) \
        if config.checkpoint else None
    if found is None:
        return Resumed(0)
    if config.log and env.is_main:
        saved = f" (saved by {found.saved_by} ranks, loaded by {env.world_size})" \
            if strategy.sharded else ""
        get_logger().info("resumed from %s%s: epoch %d done, continuing at epoch %d",
                          config.checkpoint, saved, found.start_epoch - 1, found.start_epoch)
    return found


def _end_epoch(config: TrainConfig, strategy: Strategy, env: DistEnv, record: EpochRecord,
               trained: bool, history: list[dict[str, Any]], model: nn.Module,
               optimizer: torch.optim.Optimizer, scaler) -> None:
    """Record, save and log a finished epoch, the same for every strategy.

    ``trained``: some rank took a step (the steps are summed over ranks, so
    every rank agrees). An epoch without one (no data) trained nothing: it
    enters no history and must not replace a good checkpoint.
    """
    logger = get_logger()
    if trained:
        history.append(asdict(record))
        if config.checkpoint:
            strategy.save(config.checkpoint, record.epoch, model, optimizer, scaler, history, env)
    if config.log and env.is_main and not trained:
        logger.warning("epoch %d/%d ran no training step (no data): nothing saved",
                       record.epoch + 1, config.epochs)
    elif config.log and env.is_main:
        acc = f", test accuracy {record.test_accuracy:.2%}" if record.test_accuracy is not None else ""
        logger.info("epoch %d/%d: loss %.4f%s (%.1f s, world size %d%s)", record.epoch + 1,
                    config.epochs, record.train_loss, acc, record.seconds, env.world_size,
                    ", sharded" if strategy.sharded else "")
    if config.checkpoint and _distributed():
        dist.barrier()  # nobody runs ahead of a checkpoint that is still being written
