"""A program's ranks forked warm, with the variables torchrun gives its workers.

:func:`ddpguide.launch.programs.run` runs a program with the command a reader
types: ``torchrun --standalone --nproc-per-node=4 train.py ...`` starts an agent
and four workers, five fresh interpreters that each import torch (seconds of
CPU) before the program's first line. The chapters run every program that way.

The package's tests run the same programs hundreds of times, so with
``DDPGUIDE_PROGRAM_LAUNCH=forked`` (set by ``tests/conftest.py``) ``run`` starts
the ranks of such a command (and of ``python prog.py``) forked from the warm
server of :mod:`ddpguide.launch.warm` instead. Each rank gets what torchrun's
agent gives a worker: the environment of the command with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store this
process hosts (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank is a client, as
under the agent), ``OMP_NUM_THREADS=1`` unless set, its own
``TORCHELASTIC_ERROR_FILE``; it runs the program as ``__main__`` in the
program's folder with the program's arguments, unbuffered, all ranks writing to
one output. When a rank fails, the others are stopped (SIGTERM, then SIGKILL)
and the status is 1, as the agent does.

Anything else runs as typed: other launcher options (restarts, several nodes,
rendezvous), and a command whose variables only a fresh interpreter reads
(:func:`ddpguide.launch.warm.start_method`). torchrun's own report of a failure
(``ChildFailedError``) is torchrun's; a forked run ends with one line instead,
``forked ranks: rank R exited with C``.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ddpguide.core.processes import die_with_parent, exit_now
from ddpguide.launch import warm

MODE_ENV = "DDPGUIDE_PROGRAM_LAUNCH"
#: how long the other ranks get to stop on SIGTERM after one failed (the agent gives 30 s)
TERMINATE_GRACE_S = 5.0
_NPROC = "--nproc-per-node="


def enabled() -> bool:
    """Whether :func:`ddpguide.launch.programs.run` forks the ranks of a command it can."""
    return os.environ.get(MODE_ENV, "command") == "forked"


def ranks_of(launcher: Sequence[str]) -> int | None:
    """How many ranks a launcher starts when forked ranks can stand for it: 0 for
    ``python`` (one process, no torchrun variables), N for ``torchrun --standalone
    --nproc-per-node=N``; None for any other launcher."""
    launcher = tuple(launcher)
    if launcher == ("python",):
        return 0
    if (len(launcher) == 3 and launcher[:2] == ("torchrun", "--standalone")
            and launcher[2].startswith(_NPROC) and launcher[2][len(_NPROC):].isdigit()):
        return int(launcher[2][len(_NPROC):]) or None
    return None


def torchrun_variables(rank: int, nproc: int, port: int, run_id: str, error_file: str) -> dict[str, str]:
    """What torchrun's agent sets for local worker ``rank`` of one standalone node."""
    n = str(nproc)
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": n, "WORLD_SIZE": n, "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": n, "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }


@dataclass(frozen=True)
class ProgramRank:
    """What a forked rank runs: ``argv[0]`` (a path in ``folder``) as ``__main__``;
    ``unbuffered`` as ``python -u`` (torchrun starts its workers so)."""

    folder: str
    argv: tuple[str, ...]
    unbuffered: bool = False


def rank_entry(rank: ProgramRank, start: warm.WarmStart) -> None:
    """A forked rank's life: the command's environment and output, then the program."""
    start.apply()
    die_with_parent()
    code = 1
    try:
        code = _run_program(rank)
    finally:
        exit_now(code)


def _run_program(rank: ProgramRank) -> int:
    # the streams a fresh interpreter opens on files: unbuffered under python -u or
    # PYTHONUNBUFFERED, else standard output in blocks and standard error by line
    unbuffered = rank.unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", write_through=unbuffered,
            line_buffering=fd == 2 and not unbuffered, errors="backslashreplace" if fd == 2 else "strict"))
    os.chdir(rank.folder)
    sys.argv = list(rank.argv)
    sys.path[:] = [rank.folder, *(p for p in sys.path if p not in ("", rank.folder))]
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = os.path.join(rank.folder, rank.argv[0])
    main = types.ModuleType("__main__")  # as ``python prog.py`` makes it
    main.__dict__.update(__file__=path, __builtins__=builtins, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec")
        exec(code, main.__dict__)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:  # the traceback starts in the program, as Python prints it
        tb = error.__traceback__
        traceback.print_exception(type(error), error, tb.tb_next if tb else None)
        return 1
    return 0


@dataclass
class Ended:
    """How a run ended: its status, its output (and its error output when kept apart), and
    whether it was stopped at its time limit."""

    returncode: int
    output: str
    timed_out: bool
    errors: str | None = None


def run(folder: Path, argv: Sequence[str], nproc: int, environ: Mapping[str, str], timeout: float,
        echo: Callable[[str], None] | None = None, separate_errors: bool = False) -> Ended | None:
    """Run ``argv`` (the program's file in ``folder`` and its arguments) on ``nproc`` forked
    ranks (0: one process without torchrun's variables) with the command's ``environ``; None
    when the command must run as typed (:func:`ddpguide.launch.warm.start_method`).
    ``separate_errors``: standard error in :attr:`Ended.errors`, not in the output."""
    ctx = warm.context(environ, frozenset({"PYTHONUNBUFFERED"}))  # the rank sets its streams
    if ctx.get_start_method() != "forkserver":
        return None
    import torch.distributed as dist

    scratch = Path(tempfile.mkdtemp(prefix="ddpguide-forked-"))
    output, errors = scratch / "output.txt", scratch / "errors.txt"
    output.touch()
    store = dist.TCPStore("localhost", 0, max(nproc, 1), is_master=True, wait_for_workers=False)
    run_id = str(uuid.uuid4())
    environs = [dict(environ)] if nproc == 0 else []
    for r in range(nproc):
        (scratch / f"attempt_0/{r}").mkdir(parents=True)
        environs.append({**({"OMP_NUM_THREADS": "1"} if nproc > 1 else {}), **environ,
                         **torchrun_variables(r, nproc, store.port, run_id,
                                              str(scratch / f"attempt_0/{r}/error.json"))})
    processes: list = []
    tail = _Tail(output, echo)
    first_failure = None
    try:
        for number, env in enumerate(environs):
            start = warm.WarmStart(env, str(output), str(errors) if separate_errors else None)
            process = ctx.Process(target=rank_entry, name=f"{argv[0]}-rank{number}",
                                  args=(ProgramRank(str(folder), tuple(argv), unbuffered=nproc > 0), start))
            process.start()
            processes.append(process)
        deadline = time.monotonic() + timeout
        while True:
            running = any(p.exitcode is None for p in processes)  # before the failures: no race
            first_failure = next(((r, p.exitcode) for r, p in enumerate(processes)
                                  if p.exitcode not in (None, 0)), None)
            if first_failure is not None or not running or time.monotonic() > deadline:
                break
            tail.poll()
            time.sleep(0.05)
        timed_out = first_failure is None and any(p.exitcode is None for p in processes)
        _stop(processes, grace=0.0 if timed_out else TERMINATE_GRACE_S)
        if first_failure is not None and nproc:
            with open(errors if separate_errors else output, "a") as log:
                log.write(f"forked ranks: rank {first_failure[0]} exited with {first_failure[1]}\n")
        tail.poll(final=True)
        code = processes[0].exitcode if nproc == 0 else (1 if first_failure else 0)
        return Ended(-9 if timed_out else int(code or 0), tail.text(), timed_out,
                     errors.read_text(errors="replace") if separate_errors and errors.exists() else None)
    finally:
        _stop(processes, grace=0.0)
        del store
        shutil.rmtree(scratch, ignore_errors=True)


def _stop(processes: list, grace: float) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after ``grace`` seconds."""
    for p in processes:
        if p.exitcode is None:
            p.terminate() if grace else p.kill()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


class _Tail:
    """The ranks' shared output, read as it grows (and echoed line by line)."""

    def __init__(self, path: Path, echo: Callable[[str], None] | None):
        self.path, self.echo = path, echo
        self.chunks: list[bytes] = []
        self.offset = 0
        self.shown = 0

    def poll(self, final: bool = False) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        self.chunks.append(chunk)
        if self.echo is not None:
            data = b"".join(self.chunks)
            end = len(data) if final else data.rfind(b"\n") + 1
            if end > self.shown:
                self.echo(data[self.shown:end].decode(errors="replace"))
                self.shown = end

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")
