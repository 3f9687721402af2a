"""A program's ranks forked warm, with the variables torchrun gives its workers (a test harness).

:func:`ddpguide.launch.programs.run` runs a program with the command a reader
types: ``torchrun --standalone --nproc-per-node=4 train.py ...`` starts an agent
and four workers, five fresh interpreters that each import torch (seconds of
CPU) before the program's first line. The chapters run every program that way.

The package's tests run the same programs hundreds of times, so with
``programs.run(..., launch="warm")`` (``tests/conftest.py`` sets ``programs.LAUNCH``: a
program's first run typed, later ones warm) the ranks of such a command (and of ``python prog.py``) are
forked from the warm server of :mod:`ddpguide.launch.warm` by the runner of
:mod:`ddpguide.launch.ranks`. Each rank gets what torchrun's agent gives a worker
(:func:`ddpguide.core.runtime.launcher_environment`, with a store this process
hosts: every rank is a client, as under the agent), ``OMP_NUM_THREADS=1`` unless
set, its own ``TORCHELASTIC_ERROR_FILE``; it runs the program as ``__main__`` in
the program's folder with the program's arguments, unbuffered, all ranks writing to
one output. When a rank fails, the others are stopped (SIGTERM, then SIGKILL) and
the status is 1, as the agent does; the run ends with one line,
``forked ranks: rank R exited with C``. Forked ranks leave without interpreter
teardown, so every program also runs as typed in the tests.

Why not torch's own agent with a function entrypoint (``elastic_launch`` with
``start_method="forkserver"``, as :mod:`ddpguide.elastic.node` runs it)? Its start-up
is as fast (measured side by side on 2 cores: 0.5-0.7 s against 0.5-0.6 s for two
ranks, warm), but in the caller's process it does not fit: in the main thread it
replaces the caller's SIGTERM, SIGINT, SIGHUP and SIGQUIT handlers
(``PContext.start``) and sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in the caller's
environment (``launcher/api.py``); ``elastic_launch`` blocks with no time limit; and
workers forked from the server write to the server's standard output, not to a
run's own. Each would need the wrapping this module does.

Anything else runs as typed: other launcher options (restarts, several nodes,
rendezvous), and a command whose variables only a fresh interpreter reads
(:func:`ddpguide.launch.warm.start_method`).
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import sys
import traceback
import types
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ddpguide.core.processes import exit_now
from ddpguide.core.runtime import launcher_environment
from ddpguide.launch import ranks, warm

_NPROC = "--nproc-per-node="


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


@dataclass(frozen=True)
class ProgramRank:
    """What a forked rank runs: ``argv[0]`` (a path in ``folder``) as ``__main__``;
    ``unbuffered`` as ``python -u`` (torchrun starts its workers so)."""

    folder: str
    argv: tuple[str, ...]
    unbuffered: bool = False


def rank_entry(rank: ProgramRank) -> None:
    """A forked rank's life: the program, then an exit without teardown."""
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


def run(folder: Path, argv: Sequence[str], nproc: int, environ: Mapping[str, str], timeout: float,
        echo: Callable[[str], None] | None = None, separate_errors: bool = False) -> ranks.Ended | None:
    """Run ``argv`` (the program's file in ``folder`` and its arguments) on ``nproc`` forked
    ranks (0: one process without torchrun's variables) with the command's ``environ``; None
    when the command must run as typed (:func:`ddpguide.launch.warm.start_method`).
    ``separate_errors``: standard error in :attr:`ranks.Ended.errors`, not in the output."""
    set_by_the_rank = frozenset({"PYTHONUNBUFFERED"})  # the rank sets its streams
    if warm.start_method(environ, set_by_the_rank) != "forkserver":
        return None
    import torch.distributed as dist

    store = dist.TCPStore("localhost", 0, max(nproc, 1), is_master=True, wait_for_workers=False)
    run_id = str(uuid.uuid4())
    rank = ProgramRank(str(folder), tuple(argv), unbuffered=nproc > 0)
    with ranks.Ranks(echo, separate_errors) as group:
        environs = [dict(environ)] if nproc == 0 else [
            {**({"OMP_NUM_THREADS": "1"} if nproc > 1 else {}), **environ,
             **launcher_environment(r, nproc, store.port, run_id=run_id,
                                    error_file=str(group.workdir / f"attempt_0/{r}/error.json"))}
            for r in range(nproc)]
        for number, env in enumerate(environs):
            (group.workdir / f"attempt_0/{number}").mkdir(parents=True)
            group.start(ranks.Forked(rank_entry, (rank,), env, f"{argv[0]}-rank{number}",
                                     set_by_the_rank=set_by_the_rank))
        outcome = group.wait(timeout)
        group.stop(grace=0.0 if outcome is ranks.Outcome.TIMEOUT else ranks.GRACE_S)
        failed = group.first_failure
        if failed is not None and nproc:
            with open(group.errors_path, "a") as log:
                log.write(f"forked ranks: rank {failed} exited with {group.returncode(failed)}\n")
            group.tail.poll(final=True)
        # as torchrun: 1 for a failed group; one process without it: its own status
        end = group.ended(timed_out=outcome is ranks.Outcome.TIMEOUT, failed_status=1 if nproc else None)
    del store
    return end
