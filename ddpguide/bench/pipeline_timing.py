"""Timing helpers of the pipeline benchmark: per-block forward+backward times (for
the balanced split), device synchronisation, and a count of the slow CPU
convolution kernel that small micro-batches fall into."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch
from torch import nn

from ddpguide.pipeline.stages import (
    model_blocks,
)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work before reading a clock (CPU ops are already done).
    Every GPU, since a model-parallel step spans two."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def time_blocks(model: nn.Module, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward plus backward of each block of :func:`model_blocks`
    at the batch size of ``x`` (one warm-up round first): what :func:`balanced_split` needs.

    On the CPU this is the thread's CPU time, which other programs competing for the
    cores do not inflate (run it with one thread); on a GPU, synchronised wall time.
    """
    clock = time.thread_time if x.device.type == "cpu" else time.perf_counter

    blocks = [b for _, b in model_blocks(model)]
    samples: list[list[float]] = [[] for _ in blocks]
    for round_ in range(repeats + 1):
        saved, out = [], x
        for j, block in enumerate(blocks):
            # Cut the graph between blocks so each backward can be timed alone.
            inp = out.detach().requires_grad_(j > 0)
            synchronize(x.device)
            start = clock()
            out = block(inp)
            synchronize(x.device)
            saved.append((inp, out, clock() - start))
        grad: torch.Tensor | None = torch.ones_like(out)  # None at the end: block 0's input takes none
        for j in reversed(range(len(blocks))):
            inp, out, forward_s = saved[j]
            start = clock()
            out.backward(grad)
            synchronize(x.device)
            if round_:
                samples[j].append(forward_s + clock() - start)
            grad = inp.grad
    model.zero_grad(set_to_none=True)
    return [statistics.median(s) for s in samples]


def count_slow_conv2d(model: torch.nn.Module, x: torch.Tensor) -> int:
    """How many convolutions of one forward pass ATen sends to its native
    ``_slow_conv2d`` kernel instead of oneDNN (the small-batch, one-thread cliff)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_slow_conv2d_forward")


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side logs start/stop lines straight to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
