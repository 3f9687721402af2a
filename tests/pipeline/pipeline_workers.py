"""Worker functions for the pipeline tests (importable by spawned children via sys.path)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddpguide.pipeline.schedules import build_schedule
from ddpguide.pipeline.stages import batch_loss


def build_schedules(batch_size: int, split_sizes: list[int]) -> list[dict]:
    """Build a GPipe schedule for each split size; what each attempt did and how long it took."""
    out = []
    for split_size in split_sizes:
        start = time.monotonic()
        try:
            pipe = build_schedule("gpipe", torch.nn.Linear(4, 4), batch_size, split_size,
                                  batch_loss(batch_size), torch.device("cpu"))
            error = None
            built = (pipe.is_first, pipe.is_last)
        except ValueError as exc:
            error, built = str(exc), None
        out.append({"rank": dist.get_rank(), "split_size": split_size, "error": error,
                    "built": built, "seconds": time.monotonic() - start})
    return out


#: (shape, dtype, sent transposed) of the activations the point-to-point test sends.
P2P_CASES = [
    ((), torch.float32, False),
    ((5,), torch.float64, False),
    ((2, 3, 4), torch.bfloat16, False),
    ((4, 3), torch.float16, True),  # not contiguous: sent as a contiguous copy
    ((3, 0), torch.float32, False),  # empty
    ((2, 1, 2, 1, 2, 1, 3), torch.int64, False),  # the most dimensions the header holds
    ((64, 256, 8, 8), torch.float32, False),  # a real activation's size (2 MB)
]


def p2p_activation(index: int, shape: tuple, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """A tensor whose values say which case and which element they are."""
    numel = 1
    for size in shape:
        numel *= size
    values = (torch.arange(numel, dtype=torch.float64) % 251 + 1000 * index).reshape(shape)
    if transposed:
        values = values.reshape(shape[::-1]).t()
    return values.to(dtype)


def exchange_activations(cases: list[tuple]) -> list[torch.Tensor]:
    """Rank 0 sends every case to rank 1, which sends each back doubled; both return
    what they received, in order."""
    from ddpguide.pipeline.p2p import recv_activation, send_activation

    rank, device = dist.get_rank(), torch.device("cpu")
    peer = 1 - rank
    received, pending, keep = [], [], []
    if rank == 0:
        for index, (shape, dtype, transposed) in enumerate(cases):
            tensor = p2p_activation(index, shape, dtype, transposed)
            keep.append(tensor)
            pending += send_activation(tensor, peer)
    for _, dtype, _ in cases:
        received.append(recv_activation(peer, device, dtype))
        if rank == 1:
            keep.append(received[-1] * 2)
            pending += send_activation(keep[-1], peer)
    for work in pending:
        work.wait()
    return received
