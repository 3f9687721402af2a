"""Sharded data parallelism: memory per rank and step time of DDP, ZeRO-1 and FSDP2.

``python -m ddpguide.bench sharding [--quick] [--json FILE]``

Every case (a strategy at a world size) runs in processes of its own, one after
another in one run, on the same MLP of 34 M parameters (wide layers, a small
batch, so that model state dominates memory; ``--quick``: 5 M), trained with Adam:

* ``state``: bytes of this rank's parameters, gradients and optimizer state,
  counted tensor by tensor (:func:`ddpguide.sharding.memory.count`);
* ``peak``: memory of one training step above the process's footprint
  before the model existed. On CPU: the resident set's high-water mark
  (``VmHWM``, reset just before the step through ``/proc/self/clear_refs``;
  without it, ``ru_maxrss`` over the whole run); on GPUs
  ``torch.cuda.max_memory_allocated``;
* ``step``: median time of a training step (the slowest rank's).

FSDP2 and the hand-written ZeRO-3 build the model on the meta device and
materialise only their shards, as a model too large for one rank must be built.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpguide.bench.progress import tracked
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.core.models import mlp
from ddpguide.core.runtime import worker_device
from ddpguide.launch.spawn import spawn
from ddpguide.sharding.memory import count
from ddpguide.sharding.strategies import build

MIB = 2 ** 20
CASES = (("ddp", 2), ("zero1", 2), ("fsdp2", 2), ("zero3_hand", 2),
         ("ddp", 4), ("zero1", 4), ("fsdp2", 4))
SHARDED_ON_META = ("fsdp2", "zero3_hand")
#: the MLP (width, layers): 34 M parameters; --quick, which checks what the suite reports and the
#: counted ratios, 5 M
FULL_MLP, QUICK_MLP = (2048, 8), (1024, 5)


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _reset_peak() -> bool:
    """Reset the resident high-water mark (Linux); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _rss_bytes() -> int:
    now = _status_kib("VmRSS")
    if now is not None:
        return now * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _glibc():
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        if libc.mallopt and libc.malloc_trim:  # glibc only: AttributeError elsewhere
            return libc
    return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def _memory_first_allocator() -> None:
    """Memory first: from here on every block of 1 MiB or more gets its own mapping, returned
    to the OS when freed, so that the resident set follows the live tensors (glibc's
    ``MALLOC_MMAP_THRESHOLD_``, set in the rank itself, so that a rank forked from a warm
    server measures what a fresh interpreter would)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MIB)


def _release_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc), so that a baseline is not inflated."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _fast_allocator() -> None:
    """Switch to :data:`MALLOC_ENV`'s settings for the timed steps: freed blocks are kept."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
        libc.mallopt(M_TRIM_THRESHOLD, int(MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]))


def _warm_libraries(width: int, batch: int, device: torch.device) -> None:
    """One small step, so that the libraries' first-use memory is in the baseline."""
    layer = nn.Linear(width, width, device=device)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.randn(batch, width, device=device)).sum().backward()
    optimizer.step()
    dist.all_reduce(torch.ones(1, device=device))
    del layer, optimizer
    gc.collect()
    _release_free_memory()


def _model(name: str, widths: tuple[int, ...], device: torch.device):
    if name in SHARDED_ON_META:
        with torch.device("meta"):
            model = mlp(widths)
        trainer = build(name, model, lr=1e-4, device=device)
        with torch.no_grad():  # only this rank's shards exist: initialise them where they are
            params = trainer.sharded.parameters() if trainer.sharded else trainer.model.parameters()
            for p in params:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.normal_(0.0, widths[0] ** -0.5)
        return trainer
    return build(name, mlp(widths).to(device), lr=1e-4)


def case_worker(name: str, widths: tuple[int, ...], batch: int, warmup: int, steps: int) -> dict:
    """One rank of one case: state bytes, peak bytes of one step, median step seconds."""
    _memory_first_allocator()
    device = worker_device()
    cuda = device.type == "cuda"
    torch.manual_seed(dist.get_rank())
    inputs = torch.randn(batch, widths[0], device=device)
    targets = torch.randn(batch, widths[-1], device=device)
    _warm_libraries(widths[0], batch, device)
    baseline = torch.cuda.memory_allocated(device) if cuda else _rss_bytes()
    trainer = _model(name, widths, device)
    loss_fn = nn.functional.mse_loss
    for _ in range(warmup):  # creates Adam's state; DDP rebuilds its buckets in step 2
        trainer.step(inputs, targets, loss_fn)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        method = "torch.cuda.max_memory_allocated"
    else:
        method = "VmHWM" if _reset_peak() else "ru_maxrss (whole run)"
    dist.barrier()
    trainer.step(inputs, targets, loss_fn)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    elif method == "VmHWM":
        kib = _status_kib("VmHWM")
        assert kib is not None  # _reset_peak found it
        peak = kib * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _fast_allocator()
    trainer.step(inputs, targets, loss_fn)  # fills the allocator's cache
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.step(inputs, targets, loss_fn)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"state": count(trainer), "peak": peak - baseline, "step": statistics.median(times),
            "method": method, "numel": sum(p.numel() for p in mlp(widths, device="meta").parameters())}


def _run_case(name: str, world: int, widths, batch: int, warmup: int, steps: int) -> dict:
    ranks = spawn(case_worker, world, name, widths, batch, warmup, steps, threads_per_rank=1,
                  echo=False, timeout=600)
    state = [sum(r["state"][k] for k in ("params", "grads", "optimizer")) for r in ranks]
    return {"state": max(state), "peak": max(r["peak"] for r in ranks),
            "step": max(r["step"] for r in ranks), "method": ranks[0]["method"],
            "numel": ranks[0]["numel"]}


def run(quick: bool = False) -> Report:
    """Measure every case (see the module docstring) and return the report."""
    width, layers = QUICK_MLP if quick else FULL_MLP
    widths = (width,) * (layers + 1)
    batch = 16
    warmup, steps, rounds = (2, 1, 1) if quick else (2, 4, 2)
    results: dict[tuple[str, int], list[dict]] = {case: [] for case in CASES}
    report = Report("sharding")
    with tracked(report, total=rounds * len(CASES)) as progress:
        for r in range(rounds):  # interleaved rounds: a burst of load hits every case alike
            for name, world in CASES:
                with progress.case(f"{name}, {world} ranks, round {r + 1} of {rounds}"):
                    result = _run_case(name, world, widths, batch, warmup, steps)
                    results[(name, world)].append(result)
                    progress.figure(f"{name}, {world} ranks: step", result["step"] * 1e3, "ms")
                    progress.figure(f"{name}, {world} ranks: peak", result["peak"] / MIB, "MiB")
    merged = {case: {"state": runs[0]["state"], "peak": statistics.median(r["peak"] for r in runs),
                     "step": statistics.median(r["step"] for r in runs), "method": runs[0]["method"],
                     "numel": runs[0]["numel"]}
              for case, runs in results.items()}

    numel = merged[CASES[0]]["numel"]
    details = {"model": f"MLP {layers} x Linear({width}, {width}), Adam, float32",
               "parameters": numel, "batch per rank": batch, "threads per rank": 1}
    labels = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp2": "FSDP2", "zero3_hand": "ZeRO-3 by hand"}
    for (name, world), m in merged.items():
        report.add(f"{labels[name]}, {world} ranks: state per rank", m["state"] / MIB, "MiB", **details)
        report.add(f"{labels[name]}, {world} ranks: peak of one step", m["peak"] / MIB, "MiB",
                   method=m["method"], **details)
        report.add(f"{labels[name]}, {world} ranks: step", m["step"] * 1e3, "ms", **details)

    def ratio(kind: str, a: tuple[str, int], b: tuple[str, int]) -> float:
        return merged[a][kind] / merged[b][kind]

    report.ratios["fsdp_state_over_ddp_4ranks"] = ratio("state", ("fsdp2", 4), ("ddp", 4))
    report.ratios["fsdp_peak_over_ddp_4ranks"] = ratio("peak", ("fsdp2", 4), ("ddp", 4))
    report.ratios["zero1_state_over_ddp_4ranks"] = ratio("state", ("zero1", 4), ("ddp", 4))
    report.ratios["fsdp_step_over_ddp_2ranks"] = ratio("step", ("fsdp2", 2), ("ddp", 2))
    report.ratios["hand_zero3_over_fsdp_2ranks"] = ratio("step", ("zero3_hand", 2), ("fsdp2", 2))
    report.notes.append(
        "state: parameters + gradients + Adam state per rank (largest rank); the ZeRO paper's "
        "formula gives FSDP/DDP = 1/N = 0.25 and ZeRO-1/DDP = (4 + 4 + 8/N)/16 = 0.625 at 4 ranks")
    report.notes.append(
        "peak: one step's memory above the process before the model was built; DDP also holds "
        "its gradient buckets, and inside a step Adam's temporaries and (FSDP2) a gathered "
        "layer with its gradient")
    report.notes.append(
        "step: per rank per step FSDP2 sends 3(N-1)/N model sizes (two all-gathers, one "
        "reduce-scatter), DDP 2(N-1)/N (one all-reduce): 1.5x the bytes; 4-rank times share 2 cores")
    return report
