"""Workers for the process-group tests (importable by spawned children via sys.path)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpguide.core import process_group
from ddpguide.core.processes import ephemeral_port
from ddpguide.core.runtime import DistEnv


def leave_and_rejoin(timeout_s: float, done_file: str) -> dict:
    """setup twice in spawn's group, clean up twice, join again through env:// with
    ``timeout_s``, then let rank 0 wait in a collective rank 1 never joins (rank 1
    stays in the group until rank 0 has given up and written ``done_file``)."""
    rank = dist.get_rank()
    world_group = dist.group.WORLD
    env, runtime = process_group.setup()
    again = process_group.setup()
    out = {"rank": rank, "same_group": dist.group.WORLD is world_group,
           "env": env == DistEnv.from_environ() == again[0],
           "runtime": (runtime.backend, runtime.device_type)}
    port = [ephemeral_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    process_group.cleanup()
    out["left"] = not dist.is_initialized()
    process_group.cleanup()  # a second clean-up does nothing

    os.environ["MASTER_PORT"] = str(port[0])
    torch.set_num_threads(2)
    env, runtime = process_group.setup(timeout_s=timeout_s)
    out["threads"] = torch.get_num_threads()  # back to OMP_NUM_THREADS
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["sum"] = total.item()
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = str(exc)[:300]
        out["waited"] = time.monotonic() - start
        Path(done_file).touch()
    else:
        # Stay in the group: rank 0 must time out, not lose its peer.
        deadline = time.monotonic() + 60
        while not Path(done_file).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    process_group.cleanup()
    out["left_again"] = not dist.is_initialized()
    return out
