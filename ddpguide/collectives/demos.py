"""Workers the chapter and the tests run on every rank, around :mod:`ddpguide.collectives.algorithms`.

The primitives one by one (what each rank held before and after), the ring
all-reduce step by step, every hand-written all-reduce against the library's,
and a rank that skips a collective. Each is a spawned worker: call it through
:func:`ddpguide.launch.spawn`, or several at once through
:func:`ddpguide.launch.spawn.run_several`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from ddpguide.collectives.algorithms import (
    ALGORITHMS,
    IMPLEMENTATIONS,
    all_reduce,
    pipelined_ring_all_reduce,
    ring_all_reduce,
)
from ddpguide.core.runtime import worker_device


def primitives_demo() -> dict[str, tuple]:
    """Worker: run each collective primitive once; this rank's tensor before and after.

    Element ``i`` of rank ``r`` holds ``10 r + i``, so every value says where
    it came from. Returns ``{primitive: (before, after)}``; for ``barrier`` the
    pair is ``(arrival, departure)``, read from the machine's monotonic clock.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = worker_device()
    vector = torch.arange(world, dtype=torch.float32, device=device) + 10 * rank
    single = vector[:1].clone()  # one value per rank: [10 r]

    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, device=device)

    out: dict[str, tuple] = {}
    x = vector.clone()  # even ranks send to the next odd rank
    if rank % 2 == 0 and rank + 1 < world:
        dist.send(x, rank + 1)
    elif rank % 2 == 1:
        dist.recv(x, rank - 1)
    out["send/recv"] = (vector, x)

    x = vector.clone()
    dist.broadcast(x, src=0)
    out["broadcast"] = (vector, x)

    x = empty(1)  # rank 0 holds one piece per rank
    dist.scatter(x, list(vector.chunk(world)) if rank == 0 else None, src=0)
    out["scatter"] = (vector if rank == 0 else empty(0), x)

    gathered = [empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(single, gathered, dst=0)
    out["gather"] = (single, torch.cat(gathered) if gathered is not None else single)

    x = vector.clone()
    dist.reduce(x, dst=0)
    out["reduce"] = (vector, x)  # what the other ranks hold afterwards is unspecified

    x = vector.clone()
    dist.all_reduce(x)
    out["all-reduce"] = (vector, x)

    x = empty(world)
    dist.all_gather_single(x, single)
    out["all-gather"] = (single, x)

    x = empty(1)
    dist.reduce_scatter_single(x, vector)
    out["reduce-scatter"] = (vector, x)

    x = empty(world)
    dist.all_to_all_single(x, vector)
    out["all-to-all"] = (vector, x)

    time.sleep(0.05 * rank)  # ranks arrive one after another ...
    arrival = time.monotonic()  # one clock for every process on the machine
    dist.barrier()  # ... and leave together
    out["barrier"] = (arrival, time.monotonic())
    return out


def ring_trace_demo(elements_per_chunk: int = 1) -> list[torch.Tensor]:
    """Worker: this rank's tensor before the ring all-reduce and after each step.

    Rank ``r`` starts with ``10**r`` everywhere, so the digits of a partial sum
    tell which ranks it already contains (1011: ranks 0, 1 and 3).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((world * elements_per_chunk,), 10.0**rank, dtype=torch.float64,
                   device=worker_device())
    states = [x.clone()]
    ring_all_reduce(x, trace=lambda step, phase, t: states.append(t.clone()))
    return states


def compare_with_library(sizes: tuple[int, ...] = (1, 7, 1001),
                         dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64),
                         seed: int = 0) -> dict[tuple, tuple[torch.Tensor, ...]]:
    """Worker: every hand-written all-reduce against ``dist.all_reduce`` on the same input.

    Returns ``{(algorithm, size, dtype, kind): (ours, library, this rank's input)}`` where ``kind``
    is ``"random"`` (normal values: equal up to rounding) or ``"integers"``
    (small integers: every summation order gives exactly the same result).
    ``pipelined_ring/64B`` uses tiny segments so that several are in flight.
    """
    rank, device = dist.get_rank(), worker_device()
    variants: dict[str, Callable[[torch.Tensor], object]] = {name: IMPLEMENTATIONS[name] for name in ALGORITHMS}
    variants["pipelined_ring/64B"] = lambda t: pipelined_ring_all_reduce(t, segment_bytes=64)
    variants["auto"] = lambda t: all_reduce(t, "auto")
    generator = torch.Generator().manual_seed(seed + rank)
    out: dict[tuple, tuple[torch.Tensor, ...]] = {}
    for dtype in dtypes:
        for size in sizes:
            inputs = {"random": torch.randn(size, generator=generator, dtype=dtype),
                      "integers": torch.randint(-50, 50, (size,), generator=generator).to(dtype)}
            for kind, data in inputs.items():
                library = data.to(device, copy=True)
                dist.all_reduce(library)
                for name, fn in variants.items():
                    ours = data.to(device, copy=True)
                    fn(ours)
                    out[(name, size, dtype, kind)] = (ours, library, data)
    return out


def skip_a_collective(skipping_rank: int = 1, then: str = "busy",
                      busy_s: float = 30.0) -> torch.Tensor:
    """Worker with a bug: one rank skips the all-reduce of 4 elements that the others enter.

    ``then="busy"``: the skipping rank is busy elsewhere for ``busy_s``; the
    others wait in the all-reduce until the process group's timeout and fail
    with a timeout message instead of hanging forever. ``then="next"``: it goes
    straight on to the next all-reduce, of 1 element (say, the loss for the
    log); with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` PyTorch compares the calls of
    all ranks first and names the difference.
    """
    if then not in ("busy", "next"):
        raise ValueError(f"then must be 'busy' or 'next', got {then!r}")
    device = worker_device()
    gradients, loss = torch.ones(4, device=device), torch.ones(1, device=device)
    if dist.get_rank() != skipping_rank:
        dist.all_reduce(gradients)
    elif then == "busy":
        time.sleep(busy_s)
    dist.all_reduce(loss)
    return gradients
