"""Worker functions for the launcher tests (importable by spawned children via sys.path)."""

import os
import time

import torch
import torch.distributed as dist


def report():
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "sum_of_ranks": total.item(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def fail_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        # CLOCK_MONOTONIC is one clock for every process on the machine
        raise ValueError(f"rank {bad_rank} refuses to train (raised at {time.monotonic():.3f})")
    dist.barrier()  # the healthy ranks wait here until they are stopped
    return "unreachable"


def sleep_forever():
    time.sleep(3600)


def skip_a_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(30)
    return "unreachable"


def runtime_with_two_fake_gpus():
    """What the training loop would choose on this rank if the machine had 2 GPUs."""
    import torch

    from ddpguide.core.runtime import select_runtime

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    runtime = select_runtime(2)  # what fit() asks when it is given no runtime
    return runtime.backend, runtime.device_type


def leave_without_returning():
    import os

    os._exit(0)


def parent_and_variables(names):
    """The rank's parent process (the warm server, or the caller), some variables, and the
    debug level c10d runs at (``TORCH_DISTRIBUTED_DEBUG``, read by ``import torch.distributed``)."""
    return {"parent": os.getppid(), "rank": os.environ["RANK"],
            "variables": {name: os.environ.get(name) for name in names},
            "debug_level": dist.get_debug_level().name}


def touch_and_sleep(folder_prefix: str):
    """Say the rank is up (a file named ``<prefix>-<rank>``), then wait to be killed."""
    with open(f"{folder_prefix}-{dist.get_rank()}", "w"):
        pass
    time.sleep(3600)


def keywords(**kwargs):
    """Return the keyword arguments this rank was called with."""
    return kwargs
