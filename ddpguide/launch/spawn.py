"""Run a package function on N ranks from a notebook or a script.

:func:`spawn` is ``torch.multiprocessing`` with the operational habits a book
needs:

* a free loopback port with no race: the parent hosts the rendezvous store on
  port 0 and the operating system picks the port;
* a process group that is always created with a timeout and always destroyed,
  so a mismatched collective raises instead of hanging;
* each rank's return value comes back to the caller;
* a failing rank's own traceback comes back too (plain ``mp.spawn`` in a
  notebook only says "process 0 terminated with exit code 1"), within a bounded
  time, and no child process is left running;
* what the ranks print appears in the caller's output (a notebook cell), line
  by line.
"""

from __future__ import annotations

import datetime
import inspect
import math
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ddpguide.core.runtime import DistEnv, select_runtime
from ddpguide.core.runtime import threads_per_rank as rule_threads_per_rank
from ddpguide.core.timeouts import DEFAULT_TIMEOUT_S as DEFAULT_COLLECTIVE_TIMEOUT_S
from ddpguide.core.timeouts import MAX_TIMEOUT_S
from ddpguide.launch import ranks
from ddpguide.launch.child import WorkerSpec, worker_entry

DEFAULT_TIMEOUT_S = 120.0  # the whole job's, not one collective's
#: how long the other ranks get after one failed, to write their own traceback
FAILURE_GRACE_S = 0.2


class WorkerError(RuntimeError):
    """A rank failed; carries that rank's own traceback text."""

    def __init__(self, rank: int, exitcode: int | None, details: str):
        self.rank = rank
        self.exitcode = exitcode
        self.details = details
        super().__init__(f"rank {rank} failed (exit code {exitcode}):\n{details}")


class SpawnTimeout(TimeoutError):
    """The ranks did not finish within the time limit; all were stopped."""


def _tail(path: Path, max_chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return text[-max_chars:]


def _check_arguments(fn: Any, world_size: Any, timeouts: dict[str, Any],
                     threads_per_rank: Any, env: Any, kwargs: Any = None) -> None:
    """Raise ValueError naming the first bad argument, before any process or store starts."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    name = getattr(fn, "__qualname__", "")
    if inspect.isfunction(fn) and ("<lambda>" in name or "<locals>" in name):
        # The children find fn by its module and name; these have no such address.
        raise ValueError("fn must be defined at the top level of a module, so that the ranks "
                         f"can import it; got {fn.__module__}.{name}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    for option, value in timeouts.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{option} must be a finite number of seconds > 0, got {value!r}")
        if value > MAX_TIMEOUT_S:
            raise ValueError(f"{option} must be at most {MAX_TIMEOUT_S:g} seconds (a week), "
                             f"got {value!r}")
    if threads_per_rank is not None and (not isinstance(threads_per_rank, int) or isinstance(
            threads_per_rank, bool) or threads_per_rank < 1):
        raise ValueError(f"threads_per_rank must be a positive integer or None, "
                         f"got {threads_per_rank!r}")
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"kwargs must map argument names to values, got {kwargs!r}")
    if env is not None:
        if not isinstance(env, Mapping):
            raise ValueError(f"env must map variable names to strings, got {env!r}")
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise ValueError(f"env has an invalid variable name {key!r}")
            if not isinstance(value, str):
                raise ValueError(f"env must map variable names to strings, got {key}={value!r}")


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    backend: str | None = None,
    device_type: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    threads_per_rank: int | None = None,
    env: Mapping[str, str] | None = None,
    echo: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    ``fn`` must be importable by the children (defined in a module, not in a
    notebook). Inside ``fn`` the default process group is initialised and the
    usual variables (RANK, LOCAL_RANK, WORLD_SIZE, ...) are set. Returns a list
    with each rank's return value, in rank order.

    Raises :class:`WorkerError` with the failing rank's traceback, or
    :class:`SpawnTimeout` after ``timeout`` seconds; in both cases every child
    has been stopped before the exception reaches the caller. A bad argument
    raises ValueError naming it before anything starts.
    """
    _check_arguments(fn, world_size, {"timeout": timeout, "collective_timeout": collective_timeout},
                     threads_per_rank, env, kwargs)
    runtime = select_runtime(world_size, backend, device_type)
    threads = threads_per_rank or rule_threads_per_rank(world_size)
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    group = ranks.Ranks((lambda text: print(text, end="", flush=True)) if echo else None)
    workdir = group.workdir
    spec = WorkerSpec(pickle.dumps((fn, tuple(args), dict(kwargs or {}))), world_size, runtime,
                      store.port, collective_timeout, timeout, str(workdir))
    logs = [workdir / f"rank{rank}.log" for rank in range(world_size)]
    try:
        for rank in range(world_size):
            group.start(ranks.Forked(worker_entry, (rank, spec), {
                **os.environ,
                **DistEnv(rank=rank, local_rank=rank, world_size=world_size,
                          local_world_size=world_size, master_port=store.port).as_environ(),
                # The runtime chosen here is the one every select_runtime() in the
                # child returns: the group's backend and the model's device agree.
                "DDPGUIDE_BACKEND": runtime.backend, "DDPGUIDE_DEVICE": runtime.device_type,
                "OMP_NUM_THREADS": str(threads), **(env or {}),
            }, f"ddpguide-rank{rank}", log=logs[rank]))
        outcome = group.wait(timeout, failure_grace=FAILURE_GRACE_S)
        codes = group.returncodes()
        group.stop(grace=ranks.GRACE_S if outcome is ranks.Outcome.FAILED else 0.0)
        failed = group.first_failure
        if outcome is ranks.Outcome.FAILED and failed is not None:
            rank = failed
            details = workdir / f"rank{rank}.traceback"
            text = details.read_text() if details.exists() else _tail(logs[rank])
            if getattr(fn, "__module__", None) == "__main__":
                text += (
                    "\nhint: the worker function is defined in __main__ (a notebook or the "
                    "launching script); spawned children cannot import it. Put it in a module."
                )
            raise WorkerError(rank, group.returncode(rank), text.rstrip())
        if outcome is ranks.Outcome.TIMEOUT:
            running = [r for r, c in enumerate(codes) if c is None]
            tails = "\n".join(f"--- rank {r} output ---\n{_tail(logs[r], 800)}" for r in running)
            raise SpawnTimeout(
                f"ranks {running} did not finish within {timeout:g} s and were stopped\n{tails}"
            )
        missing = [r for r in range(world_size) if not (workdir / f"rank{r}.result").exists()]
        if missing:
            rank = missing[0]
            raise WorkerError(rank, 0, (
                f"rank {rank} exited with code 0 but returned no result: the worker function "
                "ended its process itself (os._exit or a signal handler) before returning"
                f"\n{_tail(logs[rank], 800)}").rstrip())
        return [
            torch.load(workdir / f"rank{rank}.result", map_location="cpu", weights_only=False)
            for rank in range(world_size)
        ]
    finally:
        group.close()
        del store


def run_several(calls: dict[str, tuple]) -> dict:
    """Worker: run ``{name: (fn, *args)}`` one after another in one process group.

    Starting a group of ranks costs seconds; a chapter that shows many small
    things starts one and returns all their results, by name.
    """
    return {name: fn(*args) for name, (fn, *args) in calls.items()}
