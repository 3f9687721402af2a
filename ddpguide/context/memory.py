"""Peak activation memory of attention per rank, against the sequence length.

:class:`LiveBytes` counts the bytes of every tensor storage an operation creates
while it is active, and forgets them when the storage is freed: its ``peak`` is the
most memory the attention held at once beyond its inputs, exactly, on any device,
whatever the allocator caches. One process runs full attention with the math kernel
(the S x S scores exist); the ranks of a spawn run the program's ring attention on
their S/N positions, forward and backward.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddpguide.context.program import PROGRAM
from ddpguide.core.runtime import CPU_BACKEND
from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn

#: The attention the figures measure: batch 1, 2 heads of dimension 16, float64.
SHAPE = {"batch": 1, "heads": 2, "head_dim": 16}
SEQS = (256, 512, 1024, 2048)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.finalize] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive:  # a view of a storage already counted
            return
        self.live += size
        self.peak = max(self.peak, self.live)
        self._alive[key] = weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._track(item)
        return out


def _inputs(seq: int, generator: torch.Generator, dtype=torch.float64):
    shape = (SHAPE["batch"], SHAPE["heads"], seq, SHAPE["head_dim"])
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4)]


def full_attention_peak(seq: int, causal: bool = True) -> int:
    """Peak bytes of one process: forward and backward of full attention (math kernel)."""
    q, k, v, dout = _inputs(seq, torch.Generator().manual_seed(0))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with LiveBytes() as counter, sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
    return counter.peak


def ring_peak_worker(seqs: Sequence[int], causal: bool = True,
                     program: str = PROGRAM) -> list[int]:
    """On each rank of a spawn: peak bytes of the program's ring attention, for each length."""
    import torch.distributed as dist

    source = programs.load(program)
    world, rank = dist.get_world_size(), dist.get_rank()
    peaks = []
    for seq in seqs:
        q, k, v, dout = _inputs(seq // world, torch.Generator().manual_seed(rank))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with LiveBytes() as counter:
            source.RingAttention.apply(q, k, v, "contiguous", causal).backward(dout)
        peaks.append(counter.peak)
    return peaks


def sweep(seqs: Sequence[int] = SEQS, worlds: Sequence[int] = (2, 4), causal: bool = True,
          program: str = PROGRAM) -> dict[int, list[int]]:
    """{ranks: [peak bytes per rank for each sequence length]}; 1 is full attention."""
    for seq in seqs:
        for world in worlds:
            if seq % world:
                raise ValueError(f"sequence length {seq} does not split over {world} ranks")
    peaks = {1: [full_attention_peak(seq, causal) for seq in seqs]}
    for world in worlds:
        ranks = spawn(ring_peak_worker, world, list(seqs), causal, program, threads_per_rank=1,
                      echo=False, timeout=300, backend=CPU_BACKEND)
        peaks[world] = [max(per_rank) for per_rank in zip(*ranks)]
    return peaks
