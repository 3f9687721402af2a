"""The child side of :func:`ddpguide.launch.spawn.spawn`: what each rank runs.

Each rank meets the others in the parent's store, joins the process group
with a timeout, runs the function, saves its result, and leaves without
interpreter teardown. A failing rank writes its traceback and records its failure
with the runner (:func:`ddpguide.launch.rank_files.record_failure`, time-stamped), so
that the runner's one first-failure rule names the rank that failed first.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ddpguide.core.processes import exit_now
from ddpguide.core.runtime import Runtime
from ddpguide.launch.rank_files import record_failure

_ARRIVED = "ddpguide/arrived/"


@dataclass(frozen=True)
class WorkerSpec:
    #: ``pickle.dumps((fn, args, kwargs))``: unpickled by the rank inside its own error
    #: handling, so that a function it cannot import is reported like any other failure
    call: bytes
    world_size: int
    runtime: Runtime
    store_port: int
    collective_timeout_s: float
    start_timeout_s: float
    workdir: str


def worker_entry(rank: int, spec: WorkerSpec) -> None:
    """A rank's life (its environment and log already set by :mod:`ddpguide.launch.ranks`)."""
    workdir = Path(spec.workdir)
    try:
        if spec.runtime.device_type == "cuda":
            torch.cuda.set_device(spec.runtime.device(rank))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        start_timeout = datetime.timedelta(seconds=spec.start_timeout_s)
        store = dist.TCPStore(
            "127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=start_timeout
        )
        # Ranks reach this point seconds apart (each one imports torch, and a
        # busy machine runs them one after another): meet here first, under the
        # launch's own time limit, so that the short collective timeout only
        # ever bounds the collectives.
        store.set(f"{_ARRIVED}{rank}", "1")
        store.wait([f"{_ARRIVED}{r}" for r in range(spec.world_size)], start_timeout)
        store.set_timeout(timeout)
        dist.init_process_group(
            spec.runtime.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout
        )
        fn, args, kwargs = pickle.loads(spec.call)
        result = fn(*args, **kwargs)
        partial = workdir / f"rank{rank}.result.part"
        torch.save(result, partial)
        os.replace(partial, workdir / f"rank{rank}.result")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        (workdir / f"rank{rank}.traceback").write_text(traceback.format_exc())
        record_failure(rank)  # its index in the runner's group
        exit_now(1)
    exit_now(0)
