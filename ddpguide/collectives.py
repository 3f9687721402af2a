"""Collectives from scratch: the primitives, and all-reduce by hand from point-to-point messages.

Every algorithm here sums ``tensor`` in place across the ranks of ``group``
using only ``isend``/``irecv``, and is checked against ``dist.all_reduce``:

* :func:`naive_all_reduce`: everyone sends to rank 0, which adds and sends the
  sum back. Rank 0 moves ``2 (N-1)`` full tensors: it is the bottleneck.
* :func:`ring_all_reduce`: reduce-scatter then all-gather around a ring,
  ``N-1`` steps each. Every rank sends ``2 (N-1)/N`` of the tensor, whatever N.
* :func:`pipelined_ring_all_reduce`: the same ring, with each chunk cut into
  segments so that the next segment travels while this one is being added.
* :func:`recursive_doubling_all_reduce`: ``log2 N`` exchanges of the whole
  tensor with a partner at distance 1, 2, 4, ...; few steps, so it wins on small
  tensors where each step's latency dominates. Handles any N.

:func:`all_reduce` picks one by message size, and the rest of the module holds
the workers that the chapter and the tests run on every rank: the primitives
one by one, the ring step by step, the comparison with the library, and a
rank that skips a collective.

The algorithms run on gloo (CPU) and nccl (GPU) alike; they rely only on the
order of messages between two ranks, never on tags, which nccl ignores. They
keep receive buffers between calls, so they are not meant to be called from
two threads at once.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .runtime import DistEnv, select_runtime

ALGORITHMS = ("naive", "ring", "pipelined_ring", "recursive_doubling")
# Below this size the number of steps (each one a round of messages and
# wake-ups) costs more than the bytes: recursive doubling's log2(N) steps beat
# the ring's 2(N-1), although it moves and adds more data.
SMALL_MESSAGE_BYTES = 4 * 2**20
# Segments of several megabytes keep the per-message cost (Python, a wake-up
# of gloo's I/O thread) small next to the copy; up to four in flight keep the
# sockets busy while a segment is added. 8 MB measured faster than 4 MB at 2
# and 4 ranks (`python -m ddpguide.bench allreduce`); larger ones gain nothing,
# as every chunk is cut into at least two segments anyway.
# Below two segments of MIN_SEGMENT_BYTES a chunk travels whole.
DEFAULT_SEGMENT_BYTES = 8 * 2**20
MIN_SEGMENT_BYTES = 2**20
DEFAULT_IN_FLIGHT = 4


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _check(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a flat view that aliases it (the algorithms write into it)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("all-reduce by hand needs a contiguous tensor: call .contiguous() first")
    return tensor.view(-1)


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              group=None) -> list:
    """Post a receive from ``src`` and a send to ``dst``; return the requests, receive first.

    With nccl the two are grouped (``batch_isend_irecv``): a lone send to a
    peer that is itself sending would wait forever. gloo needs no grouping
    (its sends and receives are asynchronous), and posting them one by one
    costs less. Empty messages are skipped on both sides: gloo never completes
    a 0-byte send.
    """
    recv = recv if recv is not None and recv.numel() else None
    send = send if send is not None and send.numel() else None
    if dist.get_backend(group) == "nccl":
        ops = [dist.P2POp(dist.irecv, recv, group=group, group_peer=src)] if recv is not None else []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=dst))
        return dist.batch_isend_irecv(ops) if ops else []
    # Receive first: a gloo send leaves only once the peer says it is ready to receive.
    requests = [dist.irecv(recv, group=group, group_src=src)] if recv is not None else []
    if send is not None:
        requests.append(dist.isend(send, group=group, group_dst=dst))
    return requests


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(like: torch.Tensor, numel: int, slot: int = 0) -> torch.Tensor:
    """A reusable receive buffer of ``numel`` elements (kept between calls).

    A fresh multi-megabyte buffer every call costs page faults on the first
    write; keeping it costs memory: up to the largest message seen, per slot.
    """
    key = (like.dtype, like.device, slot)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place: reduce to rank 0, then rank 0 sends the sum to everyone."""
    flat = _check(tensor)
    rank, world = _rank_and_size(group)
    if world == 1 or not flat.numel():
        return tensor
    if rank == 0:
        inbox = [_scratch(flat, flat.numel(), slot) for slot in range(1, world)]
        requests = [_exchange(None, 0, buf, src, group) for src, buf in enumerate(inbox, 1)]
        for request, buf in zip(requests, inbox):  # add in rank order: same sum everywhere
            _wait(request)
            flat.add_(buf)
        _wait([r for dst in range(1, world) for r in _exchange(flat, dst, None, 0, group)])
    else:
        _wait(_exchange(flat, 0, None, 0, group))
        _wait(_exchange(None, 0, flat, 0, group))
    return tensor


def ring_steps(world: int, rank: int) -> list[tuple[str, int, int]]:
    """The ring schedule of one rank: ``(phase, chunk sent, chunk received)`` per step.

    In reduce-scatter step ``s`` rank ``r`` sends chunk ``r - s`` to its right
    neighbour and adds the chunk ``r - s - 1`` it receives from its left one;
    after ``N-1`` steps it owns the full sum of chunk ``r + 1``. All-gather then
    passes the finished chunks around the ring, ``N-1`` steps again.
    """
    steps = [("reduce-scatter", (rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)]
    steps += [("all-gather", (rank - s + 1) % world, (rank - s) % world) for s in range(world - 1)]
    return steps


def ring_all_reduce(tensor: torch.Tensor, group=None,
                    trace: Callable[[int, str, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place with the ring: reduce-scatter, then all-gather.

    ``trace(step, phase, tensor)``, when given, is called after every step
    with the tensor as it is then (the chapter draws the ring from it).
    """
    flat = _check(tensor)
    rank, world = _rank_and_size(group)
    if world == 1:
        return tensor
    chunks = flat.tensor_split(world)  # sizes differ by at most one element
    right, left = (rank + 1) % world, (rank - 1) % world
    inbox = _scratch(flat, chunks[0].numel())
    for step, (phase, sent, received) in enumerate(ring_steps(world, rank)):
        if phase == "reduce-scatter":
            buf = inbox[: chunks[received].numel()]
            _wait(_exchange(chunks[sent], right, buf, left, group))
            chunks[received].add_(buf)
        else:  # the received chunk is final: it lands in place
            _wait(_exchange(chunks[sent], right, chunks[received], left, group))
        if trace is not None:
            trace(step, phase, tensor)
    return tensor


def pipelined_ring_all_reduce(tensor: torch.Tensor, group=None,
                              segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                              in_flight: int = DEFAULT_IN_FLIGHT) -> torch.Tensor:
    """The ring with each chunk cut into segments, ``in_flight`` of them travelling at once.

    While segment ``k`` is being added, the next ones are already on the wire,
    and segment ``k`` of the next step leaves as soon as its sum is ready. The
    additions are those of :func:`ring_all_reduce`, in the same order, so the
    result is bit-identical to it.
    """
    flat = _check(tensor)
    rank, world = _rank_and_size(group)
    if world == 1:
        return tensor
    chunks = flat.tensor_split(world)
    per_segment = max(1, segment_bytes // flat.element_size())
    n_segments = -(-chunks[0].numel() // per_segment)
    if chunks[0].numel() * flat.element_size() >= 2 * min(MIN_SEGMENT_BYTES, segment_bytes):
        n_segments = max(n_segments, 2)  # something to add while something else travels
    n_segments = min(max(1, n_segments), max(1, chunks[0].numel()))
    # Segment k of step s+1 may only leave once segment k of step s is done.
    in_flight = max(1, min(in_flight, n_segments))
    segments = [c.tensor_split(n_segments) for c in chunks]
    right, left = (rank + 1) % world, (rank - 1) % world
    inboxes = [_scratch(flat, segments[0][0].numel(), slot) for slot in range(in_flight)]
    schedule = [(phase, sent, received, k)
                for phase, sent, received in ring_steps(world, rank) for k in range(n_segments)]

    def post(i: int) -> list:
        phase, sent, received, k = schedule[i]
        target = segments[received][k]
        if phase == "reduce-scatter":
            target = inboxes[i % in_flight][: target.numel()]
        requests = _exchange(segments[sent][k], right, target, left, group)
        # Sends are only waited for at the end: what they read is not written
        # again before its sum has gone round the ring.
        has_recv = bool(target.numel())
        sends.extend(requests[has_recv:])
        return requests[:has_recv]

    sends: list = []
    pending = [post(i) for i in range(in_flight)]
    for i, (phase, _, received, k) in enumerate(schedule):
        _wait(pending.pop(0))
        if phase == "reduce-scatter":
            segments[received][k].add_(inboxes[i % in_flight][: segments[received][k].numel()])
        if i + in_flight < len(schedule):
            pending.append(post(i + in_flight))
    _wait(sends)
    return tensor


def recursive_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place by exchanging it with partners ``rank XOR 1, 2, 4, ...``.

    With ``N`` not a power of two, the ``N - P`` ranks above the largest power
    of two ``P`` first hand their tensor to a partner below ``P``, wait while
    the ``P`` ranks run the exchanges, and receive the sum at the end.
    """
    flat = _check(tensor)
    rank, world = _rank_and_size(group)
    if world == 1 or not flat.numel():
        return tensor
    power = 1 << (world.bit_length() - 1)
    extra = world - power
    if rank >= power:  # fold in, then wait for the result
        _wait(_exchange(flat, rank - power, None, 0, group))
        _wait(_exchange(None, 0, flat, rank - power, group))
        return tensor
    buf = _scratch(flat, flat.numel())
    if rank < extra:
        _wait(_exchange(None, 0, buf, rank + power, group))
        flat.add_(buf)
    distance = 1
    while distance < power:
        partner = rank ^ distance
        _wait(_exchange(flat, partner, buf, partner, group))
        # a + b == b + a exactly, so both partners hold bit-identical sums
        flat.add_(buf)
        distance *= 2
    if rank < extra:
        _wait(_exchange(flat, rank + power, None, 0, group))
    return tensor


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """The algorithm :func:`all_reduce` runs for a message of ``nbytes`` on ``world_size`` ranks."""
    if world_size > 1 and nbytes < SMALL_MESSAGE_BYTES:
        return "recursive_doubling"
    return "pipelined_ring"


_IMPLEMENTATIONS = {
    "naive": naive_all_reduce,
    "ring": ring_all_reduce,
    "pipelined_ring": pipelined_ring_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
}


def all_reduce(tensor: torch.Tensor, algorithm: str = "auto", group=None) -> str:
    """Sum ``tensor`` in place across ``group`` with a hand-written algorithm.

    ``algorithm`` is one of :data:`ALGORITHMS`, or ``"auto"`` for a size-based
    choice (:func:`choose_algorithm`). Returns the name of the algorithm that ran.
    """
    if algorithm == "auto":
        algorithm = choose_algorithm(tensor.numel() * tensor.element_size(),
                                     dist.get_world_size(group))
    if algorithm not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of "
                         f"{', '.join(ALGORITHMS)} or 'auto'")
    _IMPLEMENTATIONS[algorithm](tensor, group=group)
    return algorithm


# --- Demonstrations run by the chapter and the tests (spawned workers) -------------


def worker_device() -> torch.device:
    """Where this rank's tensors live: its own GPU under nccl, else the CPU."""
    env = DistEnv.from_environ()
    return select_runtime(env.local_world_size, backend=dist.get_backend()).device(env.local_rank)


def run_several(calls: dict[str, tuple]) -> dict:
    """Worker: run ``{name: (fn, *args)}`` one after another in one process group.

    Starting a group of ranks costs seconds; a chapter that shows many small
    things starts one and returns all their results, by name.
    """
    return {name: fn(*args) for name, (fn, *args) in calls.items()}


def primitives_demo() -> dict[str, tuple]:
    """Worker: run each collective primitive once; this rank's tensor before and after.

    Element ``i`` of rank ``r`` holds ``10 r + i``, so every value says where
    it came from. Returns ``{primitive: (before, after)}``; for ``barrier`` the
    pair is ``(arrival, departure)`` wall-clock times instead.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = worker_device()
    vector = torch.arange(world, dtype=torch.float32, device=device) + 10 * rank
    single = vector[:1].clone()  # one value per rank: [10 r]

    def empty(n: int) -> torch.Tensor:
        return torch.empty(n, device=device)

    out = {}
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
    out["gather"] = (single, torch.cat(gathered) if rank == 0 else single)

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
    variants = {name: _IMPLEMENTATIONS[name] for name in ALGORITHMS}
    variants["pipelined_ring/64B"] = lambda t: pipelined_ring_all_reduce(t, segment_bytes=64)
    variants["auto"] = lambda t: all_reduce(t, "auto")
    generator = torch.Generator().manual_seed(seed + rank)
    out = {}
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
