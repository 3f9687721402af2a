"""Process-group set-up and clean-up for workers started by torchrun or by hand."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ddpguide.core.runtime import DistEnv, Runtime, limit_threads, select_runtime
from ddpguide.core.timeouts import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S  # noqa: F401 (re-exported)


def setup(env: DistEnv | None = None, runtime: Runtime | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[DistEnv, Runtime]:
    """Join the process group described by the environment (``env://``).

    Idempotent: if the default group exists already (``ddpguide.launch.spawn``
    creates it), only the environment and runtime are returned. Every
    collective of the group raises after ``timeout_s`` instead of hanging.
    """
    env = env or DistEnv.from_environ()
    runtime = runtime or select_runtime(env.local_world_size)
    if runtime.device_type == "cuda":
        torch.cuda.set_device(runtime.device(env.local_rank))
    else:
        limit_threads(env.local_world_size)
    if not dist.is_initialized():
        dist.init_process_group(
            runtime.backend, init_method="env://", rank=env.rank, world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return env, runtime


def cleanup() -> None:
    """Leave the process group (every ``setup`` needs one, or the job may hang at exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()
