"""Threads per rank: the one rule the package and the book's programs follow."""

from __future__ import annotations

import os
from typing import Mapping

import torch


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity (``taskset``, Slurm's binding), within the
    cgroup's CPU quota (a container's ``--cpus``); ``os.cpu_count()`` counts every CPU of the host."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def fair_thread_count(local_world_size: int, cpu_count: int | None = None) -> int:
    """Threads per rank so that the ranks on one machine share the CPUs this process may use."""
    cpu_count = cpu_count or usable_cpus()
    return max(1, cpu_count // max(1, local_world_size))


def threads_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """The one rule for threads per rank: ``OMP_NUM_THREADS`` where the user set it, else this
    rank's share of :func:`usable_cpus`. torchrun sets ``OMP_NUM_THREADS=1`` for several local
    workers when the user did not (its banner says so): a 1 under torchrun with several local
    ranks is taken as torchrun's, not the user's. The book's programs carry the same lines."""
    environ = os.environ if environ is None else environ
    requested = environ.get("OMP_NUM_THREADS", "").strip()
    torchruns = (requested == "1" and "TORCHELASTIC_RUN_ID" in environ and local_world_size > 1)
    if requested.isdigit() and int(requested) > 0 and not torchruns:
        return int(requested)
    return fair_thread_count(local_world_size)


def limit_threads(local_world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """Set this rank's threads by :func:`threads_per_rank` and return the count.

    ``mp.spawn`` leaves every child with all cores, so N ranks oversubscribe the
    machine N times.
    """
    threads = threads_per_rank(local_world_size, environ)
    torch.set_num_threads(threads)
    return threads
