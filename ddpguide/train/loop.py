"""The one training core of the book.

Chapter 1 meets it under ``mp.spawn``; later chapters reuse it unchanged apart
from options: where rank information comes from (torchrun), checkpoint-resume
(elastic training), mixed precision and synchronised batch norm.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.core.checkpoint import (
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from ddpguide.core.data import DataSplits, eval_loader, load_dataset, train_loader
from ddpguide.core.models import build_model
from ddpguide.core.ranklog import get_logger, progress
from ddpguide.core.runtime import DistEnv, Runtime, select_runtime
from ddpguide.train import amp as amp_mod


@dataclass
class TrainConfig:
    """Every knob of a training run; chapters add options here, never copies of the loop."""

    model: str = "convnet"
    dataset: str = "auto"
    epochs: int = 3
    batch_size: int = 32          # per rank, as in the source article
    lr: float = 0.02
    momentum: float = 0.9
    seed: int = 0                 # model initialisation (identical on every rank)
    data_seed: int = 3407         # sampler shuffling and loader generators
    max_steps_per_epoch: int | None = None
    checkpoint: str | None = None  # rank 0 saves here after every epoch; runs resume from it
    amp: str = "off"              # off | auto | bf16 | fp16
    sync_bn: bool = False
    evaluate: bool = True
    progress: bool | None = None  # progress bar on rank 0 (default: when stderr is a terminal)
    log: bool = True
    step_delay_s: float = 0.0     # sleep after each step: makes a toy run slow enough to watch

    def validate(self) -> TrainConfig:
        """Raise ValueError with one clear sentence for a bad value."""
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise ValueError(f"max_steps_per_epoch must be >= 1, got {self.max_steps_per_epoch}")
        if self.step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {self.step_delay_s}")
        if (self.amp or "off").lower() not in amp_mod.AMP_CHOICES:
            raise ValueError(f"unknown amp mode {self.amp!r}: choose one of "
                             f"{', '.join(amp_mod.AMP_CHOICES)}")
        return self


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
                  **model_kwargs) -> nn.Module:
    """Build the model with the same seed on every rank, convert BN, wrap in DDP."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, **model_kwargs)
    if config.sync_bn and _distributed():
        from ddpguide.train.syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, runtime.device_type)
    model = model.to(runtime.device(env.local_rank))
    if _distributed():
        device_ids = [runtime.device(env.local_rank).index] if runtime.device_type == "cuda" else None
        model = DDP(model, device_ids=device_ids)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int, env: DistEnv, device: torch.device,
             settings: amp_mod.AmpSettings | None = None) -> tuple[int, int]:
    """Correct predictions and samples seen, summed over all ranks, each sample counted once.

    Every rank must call this (it ends in a collective): calling it on rank 0
    only leaves rank 0 waiting for partners that never come.
    """
    settings = settings or amp_mod.AmpSettings(device.type, None)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for images, labels in eval_loader(dataset, batch_size, env.rank, env.world_size):
        images, labels = images.to(device), labels.to(device)
        with amp_mod.autocast(settings):
            logits = model(images)
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += labels.numel()
    if _distributed():
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
        data: DataSplits | None = None, on_event: EventHook | None = None) -> TrainResult:
    """Train (and evaluate) with ``config`` on this rank; every rank calls it.

    Uses the default process group if one exists (DDP), otherwise trains as a
    single process. With ``config.checkpoint``, resumes after the last saved
    epoch and has rank 0 save after every epoch.

    ``data`` replaces ``load_dataset(config.dataset)`` (e.g. the elastic
    chapter's small synthetic set). ``on_event(name, **fields)`` is called on
    every rank at ``"start"`` (``epoch`` = first epoch to run, ``resumed``),
    ``"first_step"`` (the first optimizer step of this process) and ``"epoch"``
    (at the end of every epoch, once its checkpoint, if any, is on disk:
    ``epoch``, ``loss``, ``seconds``). The checkpoint also carries the
    history of finished epochs (``TrainResult.history``) across restarts.
    """
    config.validate()
    env = env or (DistEnv.from_environ() if _distributed() else DistEnv.single())
    runtime = runtime or select_runtime(env.local_world_size)
    device = runtime.device(env.local_rank)
    logger = get_logger()
    settings = amp_mod.resolve_amp(config.amp, runtime.device_type)
    data = data if data is not None else load_dataset(config.dataset)
    emit: EventHook = on_event or (lambda name, **fields: None)
    model = prepare_model(config, env, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    scaler = amp_mod.make_scaler(settings)
    criterion = nn.CrossEntropyLoss()

    start_epoch = 0
    history: list[dict[str, Any]] = []
    if config.checkpoint:
        state = load_checkpoint(config.checkpoint, map_location=device)
        if state is not None:
            start_epoch = restore_training_state(state, model, optimizer, scaler)
            history = list(state.get("history", []))
            if config.log and env.is_main:
                logger.info("resumed from %s: epoch %d done, continuing at epoch %d",
                            config.checkpoint, start_epoch - 1, start_epoch)

    # The sampler shards by the *current* world size: after a resize every
    # rank gets its new share of the same shuffled epoch.
    loader = train_loader(data.train, config.batch_size, env.rank, env.world_size,
                          seed=config.data_seed)
    result = TrainResult(data.name, env.world_size, env.rank, start_epoch, history=history)
    emit("start", epoch=start_epoch, resumed=start_epoch > 0, world_size=env.world_size)
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
    for epoch in range(start_epoch, config.epochs):
        epoch_start = time.perf_counter()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        batches = progress(loader, config.progress, desc=f"epoch {epoch}")
        loss_sum = run_steps(batches, step, config, device, emit, epoch, env.world_size, stepped)
        stepped = stepped or bool(loss_sum[1] > 0)
        if _distributed():
            dist.all_reduce(loss_sum)
        # Steps summed over ranks, so every rank agrees: an epoch without one
        # (no data) trained nothing and must not replace a good checkpoint.
        trained = bool(loss_sum[1] > 0)
        accuracy = None
        if config.evaluate:
            correct, total = evaluate(model, data.test, 256, env, device, settings)
            accuracy = correct / total
            result.test_correct, result.test_total = correct, total
        record = EpochRecord(epoch, env.world_size, float(loss_sum[0] / loss_sum[1].clamp(min=1)),
                             accuracy, time.perf_counter() - epoch_start)
        result.epochs.append(record)
        if trained:
            history.append(asdict(record))
        if config.checkpoint and env.is_main and trained:
            save_checkpoint(training_state(epoch, model, optimizer, scaler, history=history),
                            config.checkpoint)
        if config.log and env.is_main and not trained:
            logger.warning("epoch %d/%d ran no training step (no data): nothing saved",
                           epoch + 1, config.epochs)
        elif config.log and env.is_main:
            acc = f", test accuracy {accuracy:.2%}" if accuracy is not None else ""
            logger.info("epoch %d/%d: loss %.4f%s (%.1f s, world size %d)", epoch + 1,
                        config.epochs, record.train_loss, acc, record.seconds, env.world_size)
        if config.checkpoint and _distributed():
            dist.barrier()  # nobody runs ahead of a checkpoint that is still being written
        emit("epoch", epoch=epoch, world_size=env.world_size, loss=record.train_loss,
             seconds=record.seconds)
    result.seconds = time.perf_counter() - started
    module = getattr(model, "module", model)
    result.parameters = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return result


def train_worker(config: TrainConfig) -> TrainResult:
    """The function each spawned rank runs: the training core, nothing else."""
    return fit(config)

