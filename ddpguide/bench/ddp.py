"""``python -m ddpguide.bench ddp``: what DDP costs and what it buys on this machine.

Side by side in one run, with the same allocator settings everywhere:

* the plain loop vs the same loop wrapped in DDP with one rank (overhead);
* 2 ranks x 1 thread vs 1 rank x 1 thread at the same per-rank batch (scaling);
* 1 rank x 2 threads, and two independent processes that never communicate
  (the hardware bound: what two cores can do at best);
* the toy model, where communication and bookkeeping dominate the tiny compute.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.core.models import ConvNet, ToyModel
from ddpguide.launch.spawn import spawn

CASES = {
    # name: (model factory kwargs, input shape per sample, classes)
    "convnet": ("convnet", (1, 28, 28)),
    "toy": ("toy", (10,)),
}


def _model(kind: str) -> nn.Module:
    return ConvNet() if kind == "convnet" else ToyModel()


def step_time_worker(kind: str, batch: int, steps: int, warmup: int, use_ddp: bool,
                     repeats: int = 3) -> float:
    """Median seconds per training step on this rank (synthetic data, SGD)."""
    torch.manual_seed(0)
    model = _model(kind)
    if use_ddp:
        model = DDP(model)
    shape = CASES[kind][1]
    inputs = torch.randn(batch, *shape)
    if kind == "convnet":
        targets = torch.randint(0, 10, (batch,))
        loss_fn: nn.Module = nn.CrossEntropyLoss()
    else:
        targets = torch.randn(batch, 5)
        loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def one_step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

    for _ in range(warmup):
        one_step()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        samples.append((time.perf_counter() - start) / steps)
    return statistics.median(samples)


def _measure(kind: str, batch: int, world_size: int, threads: int, use_ddp: bool,
             steps: int, warmup: int) -> float:
    per_rank = spawn(step_time_worker, world_size, kind, batch, steps, warmup, use_ddp,
                     threads_per_rank=threads, env=MALLOC_ENV, echo=False, timeout=600)
    return max(per_rank)  # the group is as fast as its slowest rank


def run(quick: bool = False) -> Report:
    """Measure every case and return the report (see the module docstring).

    The cases run in interleaved rounds (A B C ... A B C ...) and each reports
    its median over rounds, so a burst of load from elsewhere hits every case
    alike instead of one of them.
    """
    report = Report("ddp")
    batch = 256
    steps, warmup, rounds = (3, 1, 1) if quick else (8, 2, 3)
    toy_steps = 200 if quick else 1000
    cases = {
        "plain": ("convnet", batch, 1, 1, False, steps, warmup),
        "ddp1": ("convnet", batch, 1, 1, True, steps, warmup),
        "ddp2": ("convnet", batch, 2, 1, True, steps, warmup),
        "threads2": ("convnet", batch, 1, 2, False, steps, warmup),
        "independent": ("convnet", batch, 2, 1, False, steps, warmup),
        "toy1": ("toy", 64, 1, 1, True, toy_steps, 20),
        "toy2": ("toy", 64, 2, 1, True, toy_steps, 20),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, args in cases.items():
            samples[name].append(_measure(*args))
    t = {name: statistics.median(values) for name, values in samples.items()}

    case = f"ConvNet 28x28, batch {batch} per rank"
    report.add("plain loop, 1 process x 1 thread", t["plain"] * 1e3, "ms/step", case=case)
    report.add("DDP, 1 rank x 1 thread", t["ddp1"] * 1e3, "ms/step", case=case)
    report.add("DDP, 2 ranks x 1 thread", t["ddp2"] * 1e3, "ms/step", case=case)
    report.add("plain loop, 1 process x 2 threads", t["threads2"] * 1e3, "ms/step", case=case)
    report.add("2 independent processes x 1 thread", t["independent"] * 1e3, "ms/step", case=case)
    toy_case = "ToyModel, batch 64 per rank"
    report.add("toy model, DDP 1 rank", t["toy1"] * 1e6, "us/step", case=toy_case)
    report.add("toy model, DDP 2 ranks", t["toy2"] * 1e6, "us/step", case=toy_case)

    report.ratios["ddp1_over_plain"] = t["ddp1"] / t["plain"]
    report.ratios["ddp2_speedup"] = 2 * t["ddp1"] / t["ddp2"]
    report.ratios["threads2_speedup"] = t["plain"] / t["threads2"]
    report.ratios["independent2_speedup"] = 2 * t["plain"] / t["independent"]
    report.ratios["ddp2_speedup_toy"] = 2 * t["toy1"] / t["toy2"]
    report.notes.append(
        "speed-ups are throughput ratios (samples/s) against one rank with one thread; "
        "ddp1_over_plain is a time ratio (1.0 = no overhead)"
    )
    return report
