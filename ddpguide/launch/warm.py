"""Ranks started warm: forked from a server that has already imported torch.

A rank that :func:`ddpguide.launch.spawn.spawn` starts with multiprocessing's
``spawn`` method is a fresh interpreter, which imports torch and its distributed
packages (seconds of CPU) before it runs a line of the worker. multiprocessing's
``forkserver`` imports them once, in a server process of its own, and forks every
later rank from it: a rank starts in about a tenth of a second.

A fork does not take what ``spawn`` hands a fresh interpreter at its start, so
each forked rank sets it itself (:class:`WarmStart`): the caller's environment at
the moment of the start, with the rank's variables, replaces its own, and its
standard output and error go to the rank's log file. What only a fresh
interpreter reads (the C library's ``MALLOC_*`` tunables, ``LD_*``, ``PYTHON*``,
the thread libraries' ``OMP_*``/``MKL_*``/``KMP_*`` settings other than the
thread count, which the rank sets itself) or torch reads when it is imported
(``TORCH_DISTRIBUTED_DEBUG`` is read by ``import torch.distributed``, ``TORCH_LOGS``
and the ``TORCHDYNAMO_*``/``TORCHINDUCTOR_*`` settings by theirs; every ``TORCH*``,
``NCCL_*`` and ``CUDA_*`` variable is counted in) cannot be set that way: when a
start asks for values of those that the server was not started with, it uses
``spawn`` (the benchmarks, which set ``MALLOC_*``, do).
``DDPGUIDE_START_METHOD=spawn`` makes every start a fresh interpreter.

The server and multiprocessing's resource tracker start in a session of their own
(:func:`_helpers_apart`): a Jupyter kernel's shutdown signals every process of the kernel's
process group and waits until each has gone, and the tracker ignores SIGTERM, so a kernel
that had started them took about 2 s longer to shut down (measured: 2.6 s against 0.5 s).

The server is started once per process, on first use (again when the process has
changed such a variable since), and dies with it: the server imports this module
after its preload (:func:`start`), which asks the kernel to kill the server when its
parent goes (its forked ranks hold the server's "parent alive" pipe open, so the
server would not notice by itself), and each rank asks the same of the server. It
then checks what a fork needs (:func:`check_forkable`): one Python thread and no CUDA
context, and warns otherwise.
torch's agent in :mod:`ddpguide.elastic.node` forks its workers from the same kind of
server, with its own preload.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ddpguide.core.processes import die_with_parent

#: set in the parent before the server starts: the pid the server must die with
PARENT_ENV = "DDPGUIDE_WARM_PARENT"
START_METHOD_ENV = "DDPGUIDE_START_METHOD"
#: what the server imports once for every rank
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel",
           "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "ddpguide.launch.child", "ddpguide.launch.forked", "ddpguide.launch.ranks")
#: variables read when an interpreter or a library starts, not later
EXEC_TIME_PREFIXES = ("MALLOC_", "LD_", "PYTHON", "GLIBC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_",
                      "TORCH", "NCCL_", "CUDA_")
#: set by each rank from its own environment (torch.set_num_threads)
SET_BY_THE_RANK = frozenset({"OMP_NUM_THREADS"})
#: what a launcher sets that torch reads only when a rank uses it (the agent's variables,
#: read by the rendezvous and the error handler; nccl's error handling, read by a new group;
#: the flight recorder's, read when the rank's first process group makes the recorder,
#: a function-local static of ``FlightRecorder::get()`` in c10d/FlightRecorder.hpp)
READ_LATER = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_")

_server_environment: dict[str, str] | None = None


def exec_time_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that a process reads only when it starts."""
    return {key: value for key, value in environ.items() if key.startswith(EXEC_TIME_PREFIXES)
            and not key.startswith(READ_LATER) and key not in SET_BY_THE_RANK}


def start_method(environ: Mapping[str, str], set_by_the_rank: frozenset[str] = frozenset()) -> str:
    """``"forkserver"`` or ``"spawn"`` for ranks whose environment will be ``environ``: a
    fresh interpreter when asked for, or when the call's own variables (``env=``) change
    one that only a fresh interpreter reads (except ``set_by_the_rank``, which the rank
    applies itself)."""
    if os.environ.get(START_METHOD_ENV, "forkserver") == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    mine, theirs = exec_time_variables(os.environ), exec_time_variables(environ)
    for key in set_by_the_rank:
        mine.pop(key, None)
        theirs.pop(key, None)
    return "forkserver" if mine == theirs else "spawn"


def context(environ: Mapping[str, str], set_by_the_rank: frozenset[str] = frozenset()) -> Any:
    """The multiprocessing context for ranks whose environment will be ``environ``.

    The server runs with this process's environment: it is started on first use, and
    started again when this process has changed a variable that only a fresh interpreter
    reads since (a notebook cell that sets one, a library that sets one for itself), or
    when it has died."""
    import torch.multiprocessing as mp

    if start_method(environ, set_by_the_rank) == "spawn":
        from multiprocessing import resource_tracker

        with _helpers_apart():  # a spawned rank would start the tracker in this process group
            resource_tracker.ensure_running()
        return mp.get_context("spawn")
    global _server_environment
    mine = exec_time_variables(os.environ)
    pid = server_pid()
    exited = pid is None or _has_exited(pid)
    if _server_environment != mine or exited:
        if pid is not None and not exited:  # never signal a pid another process may have now
            _kill(pid)
        start()
        _server_environment = mine
    return mp.get_context("forkserver")


def _has_exited(pid: int) -> bool:
    """Whether the server has exited (not reaped: multiprocessing reaps it itself)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(pid: int) -> None:
    """Kill the server (its ranks die with it) and wait until it has exited, leaving it to
    multiprocessing to reap and start anew."""
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except (ProcessLookupError, ChildProcessError):
        pass


def start(preload: Sequence[str] = PRELOAD) -> None:
    """Start multiprocessing's forkserver of this process now, importing ``preload`` in it;
    it dies with this process and checks itself after the preload (see the module)."""
    from multiprocessing import forkserver

    os.environ[PARENT_ENV] = str(os.getpid())  # for the server only, see the module's end
    try:
        multiprocessing.set_forkserver_preload([*preload, __name__])  # this module last
        with _helpers_apart():
            forkserver.ensure_running()
    finally:
        del os.environ[PARENT_ENV]


def _start_apart(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
    """``multiprocessing.util.spawnv_passfds`` (the start of the forkserver and of the resource
    tracker), with the helper in a session of its own."""
    import subprocess

    helper = subprocess.Popen(list(args), executable=path, close_fds=True, pass_fds=tuple(sorted(passfds)),
                              restore_signals=False, start_new_session=True)
    # multiprocessing waits for the helper itself: with a status set, the Popen object
    # neither reaps it nor warns that it still runs when it is collected
    helper.returncode = 0
    return helper.pid


@contextlib.contextmanager
def _helpers_apart():
    """multiprocessing's helpers started while inside, in sessions of their own (see the module)."""
    from multiprocessing import util

    spawnv_passfds = util.spawnv_passfds
    util.spawnv_passfds = _start_apart
    try:
        yield
    finally:
        util.spawnv_passfds = spawnv_passfds


def check_forkable() -> list[str]:
    """What makes this process unsafe to fork ranks from: a Python thread besides the main
    one (a fork copies only the calling thread; a lock another thread holds stays held in
    every rank), a CUDA context (a forked rank cannot use it).

    Native threads are not counted: ``import torch`` alone leaves one, its thread pool's
    (measured: two tasks in ``/proc/self/task`` after the import, one with
    ``OMP_NUM_THREADS=1``), and every rank forked from the server starts with that."""
    import threading

    problems = []
    if threading.active_count() != 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        problems.append(f"Python threads {names} after the preload (a fork copies only one)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("a CUDA context after the preload (a forked rank cannot use it)")
    return problems


def server_pid() -> int | None:
    """The pid of this process's warm server, or None when none was started."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


@dataclass(frozen=True)
class WarmStart:
    """What a forked rank sets first: the environment it would have been spawned with,
    and its log file as standard output and error (``errors``: another file for the error)."""

    environ: dict[str, str]
    log: str
    errors: str | None = None

    def apply(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.environ.clear()
        os.environ.update(self.environ)
        for target, path in ((1, self.log), (2, self.errors or self.log)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, target)
            os.close(fd)


def forked_entry(start: Any, target: Callable[..., Any], args: tuple) -> None:
    """A forked rank's first steps: its own environment and log, death with its parent."""
    start.apply()
    die_with_parent()
    target(*args)


@contextlib.contextmanager
def exec_time_environment(environ: Mapping[str, str], method: str):
    """For a rank that must be a fresh interpreter (``spawn``), the variables only an
    interpreter's start reads are this process's while it starts the rank (``environ``
    without the group's marker: this process is no member of the group)."""
    if method == "forkserver":
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started now, it does not carry the rank's variables
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


if os.environ.get(PARENT_ENV) == str(os.getppid()):
    # this process is the server its parent started (nothing else inherits the variable)
    die_with_parent()
    for problem in check_forkable():
        warnings.warn(f"ddpguide warm server: {problem}", RuntimeWarning, stacklevel=1)
