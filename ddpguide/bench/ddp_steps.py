"""The worker side of ``python -m ddpguide.bench ddp``: the training steps it times, and
the two ways it times them.

* :func:`interleaved_worker` builds the plain loop and every DDP variant in ONE process
  (a one-rank group) and times them step by step in alternation (:func:`interleave`):
  whatever slows the machine for a moment slows the neighbouring steps of every case,
  and the cases share one allocator, one core and one memory layout;
* :func:`step_time_worker` times one case alone in its own process (or its own group of
  processes): the only way to time two ranks, and the way the suite first measured
  DDP's cost on one rank.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.core.models import ConvNet, ToyModel

#: Input shape of one sample of each model.
SHAPES = {"convnet": (1, 28, 28), "toy": (10,)}

#: DDP's options that can make one rank cheaper, each measured alone and then together.
#: ``forward_sync_buffers`` replaced ``broadcast_buffers`` (deprecated since torch 2.13);
#: :func:`ddp_options` picks the name the installed torch knows.
VARIANTS: dict[str, dict[str, bool]] = {
    "ddp": {},
    "no_buffer_sync": {"forward_sync_buffers": False},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "batched_copy": {"batched_grad_copy": True},
    "all_flags": {"forward_sync_buffers": False, "gradient_as_bucket_view": True,
                  "static_graph": True, "batched_grad_copy": True},
}

#: The clocks read around each step: wall time (what a reader waits for) and the CPU
#: time of the whole process, every thread included (gloo's and autograd's too), which
#: other programs competing for the cores inflate much less.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def ddp_options(variant: str) -> dict[str, bool] | None:
    """Keyword arguments of ``DistributedDataParallel`` for ``variant``, in the installed
    torch's spelling; None when this torch lacks one of them."""
    known = inspect.signature(DDP.__init__).parameters
    options = {}
    for name, value in VARIANTS[variant].items():
        if name == "forward_sync_buffers" and name not in known:
            name = "broadcast_buffers"  # torch before 2.13: the same switch
        if name not in known:
            return None
        options[name] = value
    return options


def supported_variants() -> list[str]:
    """The variants of :data:`VARIANTS` the installed torch can build."""
    return [name for name in VARIANTS if ddp_options(name) is not None]


def make_step(kind: str, batch: int, variant: str | None) -> Callable[[], None]:
    """One SGD training step on a fixed synthetic batch: the plain loop when ``variant``
    is None, else the model wrapped in DDP with that variant's options. The same seed
    gives every case the same weights and data."""
    torch.manual_seed(0)
    model: nn.Module = ConvNet() if kind == "convnet" else ToyModel()
    if variant is not None:
        model = DDP(model, **ddp_options(variant))
    inputs = torch.randn(batch, *SHAPES[kind])
    if kind == "convnet":
        targets = torch.randint(0, 10, (batch,))
        loss_fn: nn.Module = nn.CrossEntropyLoss()
    else:
        targets = torch.randn(batch, 5)
        loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        optimizer.step()

    return step


def rotated(names: list[str], round_: int) -> list[str]:
    """``names`` rotated left by ``round_`` places: round 0 A B C, round 1 B C A, ..."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def interleave(steps: Mapping[str, Callable[[], object]], rounds: int,
               clocks: Mapping[str, Callable[[], float]] = CLOCKS) -> dict[str, dict[str, list[float]]]:
    """Run one step of every case per round, the order rotated by one each round (so no
    case always goes first or always follows the same one); return, per clock, each
    case's seconds per step in round order: ``{clock: {case: [s, ...]}}``."""
    names = list(steps)
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in clocks}
    for r in range(rounds):
        for name in rotated(names, r):
            start = {c: read() for c, read in clocks.items()}
            steps[name]()
            for c, read in clocks.items():
                times[c][name].append(read() - start[c])
    return times


def interleaved_worker(kind: str, batch: int, rounds: int, warmup: int,
                       variants: list[str]) -> dict:
    """Rank 0 of a one-rank group: the plain loop (``plain``) and each DDP variant,
    timed step by step in alternation. Warm-up steps first (DDP rebuilds its buckets
    in its second step); returns :func:`interleave`'s times and the thread count."""
    steps = {"plain": make_step(kind, batch, None)}
    steps.update({name: make_step(kind, batch, name) for name in variants})
    for step in steps.values():
        for _ in range(warmup):
            step()
    return {"times": interleave(steps, rounds), "threads": torch.get_num_threads()}


def step_time_worker(kind: str, batch: int, steps: int, warmup: int, variant: str | None,
                     repeats: int = 3) -> float:
    """Median seconds per training step of one case on this rank (blocks of ``steps``
    steps, the ranks starting each block together)."""
    one_step = make_step(kind, batch, variant)
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
