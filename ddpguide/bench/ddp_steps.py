"""The worker side of ``python -m ddpguide.bench ddp``: the training steps it times, and
the two ways it times them.

* :func:`interleaved_worker` runs on two ranks and times every case step by step in
  alternation (:func:`interleave`): on rank 0 alone (rank 1 waits) the plain loop and
  DDP with each of its options on a one-rank group; on both ranks at once two
  independent plain loops and DDP on two ranks. Whatever slows the machine for a
  moment slows neighbouring steps of every case, and the one-rank cases share one
  process, allocator and memory layout;
* :func:`step_time_worker` times one case alone in its own processes, the way the
  suite first measured everything.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.bench.progress import tick
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


def ddp_options(variant: str) -> dict[str, Any] | None:
    """Keyword arguments of ``DistributedDataParallel`` for ``variant``, in the installed
    torch's spelling; None when this torch lacks one of them."""
    known = inspect.signature(DDP.__init__).parameters
    options: dict[str, Any] = {}
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


def make_step(kind: str, batch: int, variant: str | None,
              group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """One SGD training step on a fixed synthetic batch: the plain loop when ``variant``
    is None, else the model wrapped in DDP with that variant's options, reducing over
    ``group`` (the default group when None). The same seed gives every case the same
    weights and data."""
    torch.manual_seed(0)
    model: nn.Module = ConvNet() if kind == "convnet" else ToyModel()
    if variant is not None:
        options = ddp_options(variant)
        if options is None:
            raise ValueError(f"the installed torch's DDP lacks an option of variant {variant!r}")
        model = DDP(model, process_group=group, **options)
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
               clocks: Mapping[str, Callable[[], float]] = CLOCKS,
               before: Callable[[], object] = lambda: None,
               after_round: Callable[[int], object] = lambda r: None
               ) -> dict[str, dict[str, list[float]]]:
    """Run one step of every case per round, the order rotated by one each round (so no
    case always goes first or always follows the same one), calling ``before`` (untimed)
    ahead of each step and ``after_round(r)`` after round ``r``; return, per clock, each
    case's seconds per step in round order: ``{clock: {case: [s, ...]}}``."""
    names = list(steps)
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in clocks}
    for r in range(rounds):
        for name in rotated(names, r):
            before()
            start = {c: read() for c, read in clocks.items()}
            steps[name]()
            for c, read in clocks.items():
                times[c][name].append(read() - start[c])
        after_round(r)
    return times


#: The cases of :func:`interleaved_worker` that run on both ranks; the others run on rank 0.
BOTH_RANKS = ("independent", "ddp2")


def interleaved_worker(kind: str, batch: int, rounds: int, warmup: int,
                       variants: list[str]) -> dict:
    """One of two ranks: every case step by step in alternation, a barrier (untimed)
    before each step so that the ranks start together and rank 1 waits, idle, while
    rank 0 runs a one-rank case. Cases: ``plain``, each DDP variant on a group of
    rank 0 alone, then :data:`BOTH_RANKS`: two plain loops that never communicate and
    DDP on both ranks. Warm-up rounds first (DDP rebuilds its buckets in its second
    step); returns this rank's :func:`interleave` times (0 for a case it sits out)."""
    rank = dist.get_rank()
    alone = dist.new_group([0])  # every rank takes part in creating a group

    def sit_out() -> None:
        pass

    steps: dict[str, Callable[[], None]] = {"plain": make_step(kind, batch, None) if rank == 0 else sit_out}
    for name in variants:
        if isinstance(alone, dist.ProcessGroup):  # rank 0, the group's one member
            steps[name] = make_step(kind, batch, name, group=alone)
        else:
            steps[name] = sit_out
    steps["independent"] = make_step(kind, batch, None)
    steps["ddp2"] = make_step(kind, batch, "ddp")
    interleave(steps, warmup, before=dist.barrier)

    def report_round(r: int) -> None:  # one case of the suite's progress bar, from rank 0
        if rank == 0:
            tick(f"interleaved round {r + 1} of {rounds}")

    return {"times": interleave(steps, rounds, before=dist.barrier, after_round=report_round),
            "threads": torch.get_num_threads()}


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
