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

:func:`all_reduce` picks one by message size. The workers that the chapter
and the tests run on every rank are in :mod:`ddpguide.collectives.demos`.

The algorithms run on gloo (CPU) and nccl (GPU) alike: every message goes
through :func:`ddpguide.collectives.p2p.send_recv`, which knows how each
backend must be asked. They
keep receive buffers between calls, so they are not meant to be called from
two threads at once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ddpguide.collectives.p2p import send_recv, wait

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


def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` in place: reduce to rank 0, then rank 0 sends the sum to everyone."""
    flat = _check(tensor)
    rank, world = _rank_and_size(group)
    if world == 1 or not flat.numel():
        return tensor
    if rank == 0:
        inbox = [_scratch(flat, flat.numel(), slot) for slot in range(1, world)]
        requests = [send_recv(None, 0, buf, src, group) for src, buf in enumerate(inbox, 1)]
        for request, buf in zip(requests, inbox):  # add in rank order: same sum everywhere
            wait(request)
            flat.add_(buf)
        wait([r for dst in range(1, world) for r in send_recv(flat, dst, None, 0, group)])
    else:
        wait(send_recv(flat, 0, None, 0, group))
        wait(send_recv(None, 0, flat, 0, group))
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
            wait(send_recv(chunks[sent], right, buf, left, group))
            chunks[received].add_(buf)
        else:  # the received chunk is final: it lands in place
            wait(send_recv(chunks[sent], right, chunks[received], left, group))
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
        requests = send_recv(segments[sent][k], right, target, left, group)
        # Sends are only waited for at the end: what they read is not written
        # again before its sum has gone round the ring.
        has_recv = bool(target.numel())
        sends.extend(requests[has_recv:])
        return requests[:has_recv]

    sends: list = []
    pending = [post(i) for i in range(in_flight)]
    for i, (phase, _, received, k) in enumerate(schedule):
        wait(pending.pop(0))
        if phase == "reduce-scatter":
            segments[received][k].add_(inboxes[i % in_flight][: segments[received][k].numel()])
        if i + in_flight < len(schedule):
            pending.append(post(i + in_flight))
    wait(sends)
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
        wait(send_recv(flat, rank - power, None, 0, group))
        wait(send_recv(None, 0, flat, rank - power, group))
        return tensor
    buf = _scratch(flat, flat.numel())
    if rank < extra:
        wait(send_recv(None, 0, buf, rank + power, group))
        flat.add_(buf)
    distance = 1
    while distance < power:
        partner = rank ^ distance
        wait(send_recv(flat, partner, buf, partner, group))
        # a + b == b + a exactly, so both partners hold bit-identical sums
        flat.add_(buf)
        distance *= 2
    if rank < extra:
        wait(send_recv(flat, rank + power, None, 0, group))
    return tensor


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """The algorithm :func:`all_reduce` runs for a message of ``nbytes`` on ``world_size`` ranks."""
    if world_size > 1 and nbytes < SMALL_MESSAGE_BYTES:
        return "recursive_doubling"
    return "pipelined_ring"


IMPLEMENTATIONS = {
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
    if algorithm not in IMPLEMENTATIONS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of "
                         f"{', '.join(ALGORITHMS)} or 'auto'")
    IMPLEMENTATIONS[algorithm](tensor, group=group)
    return algorithm
