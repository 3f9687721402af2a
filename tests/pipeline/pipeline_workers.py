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
