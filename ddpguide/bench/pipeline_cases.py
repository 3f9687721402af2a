"""The measuring side of the pipeline benchmark: ResNet50 training steps timed on two processes.

:class:`Case` names one configuration (one process with one or two threads, naive model
parallelism, or a 2-stage pipeline with its schedule, micro-batch size and split point);
:func:`measure` runs a list of them on 2 processes x 1 thread in interleaved rounds and
returns seconds per step, with the per-block times that choose the balanced split.
Around it: channels-last stages that send contiguous tensors, per-block and per-step
timers, the input batch, and a count of the convolutions that fall back to ``_slow_conv2d``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddpguide.bench.pipeline_timing import synchronize, time_blocks
from ddpguide.bench.progress import tick
from ddpguide.bench.report import MALLOC_ENV
from ddpguide.core.runtime import worker_device
from ddpguide.launch.spawn import spawn
from ddpguide.pipeline.model_parallel import (
    ModelParallelResNet50,
    default_devices,
    load_resnet_weights,
)
from ddpguide.pipeline.schedules import build_schedule, library_step
from ddpguide.pipeline.stages import (
    SEED_SPLIT,
    balanced_split,
    batch_loss,
    build_resnet50,
    model_blocks,
    split_model,
)

NUM_CLASSES = 1000


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        return x.contiguous(memory_format=memory_format)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.contiguous(), None


class Relayout(nn.Module):
    """Convert the activation to ``memory_format``; hand back a plain contiguous gradient.

    gloo sends and receives only contiguous (NCHW-ordered) tensors, while
    channels-last convolutions are faster on CPUs: a stage converts at its edges.
    """

    def __init__(self, memory_format: torch.memory_format) -> None:
        super().__init__()
        self.memory_format = memory_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Relayout.apply(x, self.memory_format)


def channels_last_stages(stages: Sequence[nn.Module]) -> list[nn.Sequential]:
    """Stages that compute in channels-last but send and receive contiguous tensors."""
    wrapped = []
    for i, stage in enumerate(stages):
        parts = [stage.to(memory_format=torch.channels_last)]
        if i > 0:
            parts.insert(0, Relayout(torch.channels_last))
        if i < len(stages) - 1:
            parts.append(Relayout(torch.contiguous_format))
        wrapped.append(nn.Sequential(*parts))
    return wrapped


def balanced_split_point(block_times: list[float], names: list[str]) -> str:
    """The first block of stage 1 that best balances two stages (may be the source's own cut)."""
    return names[balanced_split(block_times, 2)[0]]


def make_batch(batch: int, image_size: int, channels_last: bool, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image_size, image_size, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(device), torch.randint(0, NUM_CLASSES, (batch,), generator=gen).to(device)


def _prepare(model: torch.nn.Module, channels_last: bool) -> torch.nn.Module:
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _whole_model_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = batch_loss(x.shape[0])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss_fn(out, y.to(out.device)).backward()  # a split model answers on its last device
        opt.step()
    return step


@dataclass(frozen=True)
class Case:
    """One measured case. ``kind``: ``single``, ``threads2`` or ``model_parallel`` (rank 0
    alone, the other rank idle) or ``pipeline`` (both ranks). ``split_point`` may be
    :data:`BALANCED`, resolved from the block times measured in the same run."""

    kind: str
    schedule: str = ""
    split_size: int = 0
    split_point: str = SEED_SPLIT

    def name(self, balanced: str) -> str:
        labels = {"single": "1 process x 1 thread, whole model",
                  "threads2": "1 process x 2 threads, whole model",
                  "model_parallel": "naive model parallel (2 halves), 1 thread"}
        if self.kind in labels:
            return labels[self.kind]
        point = balanced if self.split_point == BALANCED else self.split_point
        return f"pipeline 2x1 {self.schedule}, stage 1 from {point}, micro-batch {self.split_size}"


BALANCED = "balanced"
BASELINES = (Case("single"), Case("model_parallel"), Case("threads2"))


def _runner(case: Case, model, rank: int, x, y, balanced: str, channels_last: bool, device):
    """A no-argument training step for ``case`` on this rank (a no-op where the rank idles)."""
    if case.kind != "pipeline":
        if rank != 0:
            return lambda: None
        if case.kind == "model_parallel":
            split = ModelParallelResNet50(devices=default_devices(2), num_classes=NUM_CLASSES)
            load_resnet_weights(split, model.state_dict())
            model = _prepare(split, channels_last)
        step = _whole_model_step(model, x, y)
        if case.kind != "threads2":
            return step

        def two_threads() -> None:
            torch.set_num_threads(2)
            try:
                step()
            finally:
                torch.set_num_threads(1)
        return two_threads
    point = balanced if case.split_point == BALANCED else case.split_point
    stages = split_model(model, [point])
    stage = (channels_last_stages(stages) if channels_last else stages)[rank].to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    batch = x.shape[0]
    pipe = build_schedule(case.schedule, stage, batch, case.split_size, batch_loss(batch), device)

    def pipeline_step() -> None:
        opt.zero_grad(set_to_none=True)
        library_step(pipe, x, y)
        opt.step()
    return pipeline_step


def bench_worker(cases: list[Case], batch: int, image_size: int, rounds: int, repeats: int,
                 profile_size: int, channels_last: bool = True) -> dict:
    """Every rank of 2 (one thread each): time the blocks (rank 0), pick the balanced split,
    then run all cases in ``rounds`` interleaved rounds of ``repeats`` steps each (plus one
    warm-up step the first time), so a burst of load from elsewhere hits every case alike.
    Returns this rank's seconds per step, per case and round."""
    device = worker_device()
    model = _prepare(build_resnet50(0, NUM_CLASSES), channels_last).to(device)
    x, y = make_batch(batch, image_size, channels_last, device)
    names = [name for name, _ in model_blocks(model)]
    profile: list[Any] = [None, None]  # rank 0's block times and balanced split, for every rank
    if dist.get_rank() == 0:
        blocks = time_blocks(model, x[:profile_size], repeats=max(2, repeats))
        profile = [blocks, balanced_split_point(blocks, names)]
    dist.broadcast_object_list(profile, src=0)
    blocks, balanced = profile
    rank0 = dist.get_rank() == 0
    if rank0:  # the suite's progress: one case for the profile, then one per case and round
        tick(f"profile of {len(names)} blocks: stage 1 from {balanced} balances them")
    # A balanced case that resolves to the source's cut is not measured twice.
    first_of: dict[str, int] = {}
    same_as = [first_of.setdefault(c.name(balanced), i) for i, c in enumerate(cases)]
    runners = [_runner(c, model, dist.get_rank(), x, y, balanced, channels_last, device)
               if same_as[i] == i else None for i, c in enumerate(cases)]
    times: list[list[list[float]]] = [[[] for _ in range(rounds)] for _ in cases]
    for r in range(rounds):
        for c, step in enumerate(runners):
            if step is None:
                times[c] = times[same_as[c]]
                continue
            for i in range(repeats + (r == 0)):
                dist.barrier()
                start = time.perf_counter()
                step()
                synchronize(device)
                if r or i:
                    times[c][r].append(time.perf_counter() - start)
            if rank0:
                label = cases[c].name(balanced)
                tick(f"{label}, round {r + 1} of {rounds}",
                     [(f"{label}, round {r + 1} (rank 0)", statistics.median(times[c][r]) * 1e3,
                       "ms/step")])
    return {"times": times, "block_times": blocks, "block_names": names, "balanced": balanced}


def measure(cases: list[Case], batch: int, image_size: int, rounds: int = 1, repeats: int = 2,
            profile_size: int = 16, channels_last: bool = True, env: dict | None = MALLOC_ENV) -> dict:
    """Run :func:`bench_worker` on 2 processes x 1 thread with ``env`` (:data:`MALLOC_ENV`;
    None: this process's settings, so that the ranks may be forked warm).

    A step lasts as long as its slower rank. Returns ``samples``, a dict from case
    to the seconds of every timed step (``rounds x repeats`` of them), ``seconds``,
    their median, the block times and names, and the balanced split point.
    """
    per_rank = spawn(bench_worker, 2, cases, batch, image_size, rounds, repeats, profile_size,
                     channels_last, threads_per_rank=1, env=env, echo=False,
                     timeout=3600, collective_timeout=900)
    samples = {
        case: [max(ts) for k in range(rounds) for ts in zip(*(r["times"][c][k] for r in per_rank))]
        for c, case in enumerate(cases)
    }
    rank0 = per_rank[0]
    return {"samples": samples,
            "seconds": {case: statistics.median(ts) for case, ts in samples.items()},
            "block_times": rank0["block_times"], "block_names": rank0["block_names"],
            "balanced": rank0["balanced"]}
