"""``torch.compile`` over DDP against eager DDP: step time, side by side (chapter 1).

One rank (a process group of one, gloo on the CPU, nccl on a GPU) trains the book's
ConvNet wrapped in ``DistributedDataParallel`` twice from the same weights: eagerly, and
compiled with ``torch.compile`` (inductor; on a CPU it generates C++ that gcc compiles).
The compilation is timed on its own (the first steps); then the two take turns step by
step for every round, so a burst of load from elsewhere hits both alike. The ratio is
compiled / eager seconds per step (below 1: compiled is faster).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.bench.progress import tick, tracked
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.core.models import ConvNet
from ddpguide.core.runtime import worker_device
from ddpguide.launch.spawn import spawn

BATCH = 64


def _rounds(quick: bool) -> tuple[int, int]:
    """Timed rounds, and warm-up steps of each (the compiled side compiles in the first)."""
    return (5, 2) if quick else (30, 3)


def measure(quick: bool) -> dict:
    """Worker: compilation seconds, and seconds per step of each side for every round."""
    rounds, warmup = _rounds(quick)
    device = worker_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = ConvNet().to(device)
    ids = [device.index] if device.type == "cuda" else None
    sides: dict[str, Any] = {"eager": DDP(model, device_ids=ids),
             "compiled": torch.compile(DDP(copy.deepcopy(model), device_ids=ids))}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in sides.items()}
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(BATCH, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (BATCH,), generator=generator).to(device)

    def step(name: str) -> float:
        start = time.perf_counter()
        optimizers[name].zero_grad()
        F.cross_entropy(sides[name](images), labels).backward()
        optimizers[name].step()
        sync()
        return time.perf_counter() - start

    out: dict = {"device": str(device), "threads": torch.get_num_threads(),
                 "times": {name: [] for name in sides}}
    for name in sides:
        first = [step(name) for _ in range(warmup)]
        out[f"{name}_warmup"] = sum(first)
        tick(f"{name}: warm-up", [(f"{name}: first {warmup} steps", sum(first), "s")])
    for r in range(rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):  # alternate who goes first
            out["times"][name].append(step(name))
        tick(f"round {r + 1} of {rounds}",
             [(f"{name} step", out["times"][name][-1] * 1e3, "ms") for name in sides])
    return out


def run(quick: bool = False) -> Report:
    """The suite: one fresh process compares both sides (see the module docstring)."""
    report = Report("compile")
    rounds, warmup = _rounds(quick)
    with tracked(report, total=2 + rounds):  # the worker ticks
        (result,) = spawn(measure, 1, quick, env=MALLOC_ENV, echo=False, timeout=900)
    details = {"model": "ConvNet 28x28", "batch": BATCH, "device": result["device"],
               "threads": result["threads"], "rounds": rounds}
    for name in ("eager", "compiled"):
        report.add(f"DDP {name}: step", statistics.median(result["times"][name]) * 1e3, "ms",
                   **details)
    for name in ("eager", "compiled"):
        report.add(f"DDP {name}: first {warmup} steps", result[f"{name}_warmup"], "s",
                   note="the compiled side compiles here" if name == "compiled" else "")
    report.add_ratio("compiled_over_eager_time", [c / e for c, e in zip(result["times"]["compiled"],
                                                                          result["times"]["eager"])])
    report.notes.append("one rank; each round times one step of each side, the order alternating; "
                        "the ratio is the median over rounds of compiled / eager seconds per step.")
    return report
