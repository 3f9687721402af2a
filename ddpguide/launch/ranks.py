"""The one runner: start ranks, watch them against a deadline, stop them, say how they ended.

Every process the package starts for a lesson or a check goes through :class:`Ranks`:

* a rank is a :class:`Command` (exec'd, in a session of its own, optionally under a
  ``prefix`` such as ``ip netns exec NODE``) or a :class:`Forked` call (a function run in a
  process forked from the warm server of :mod:`ddpguide.launch.warm`);
* every rank writes to a log file (by default the group's one shared output, as
  torchrun's workers share its terminal); one tail reads the logs as they grow and
  echoes whole lines only;
* one deadline loop (:meth:`Ranks.wait`), ending in an :class:`Outcome`, in one of two
  modes: first failure (a rank exits with a status other than 0; the others get
  ``failure_grace`` seconds to notice and end on their own) or, with ``all_end``, until
  every rank has ended whatever each one's status;
* one first-failure rule (:attr:`Ranks.first_failure`): as torch's agent picks the error
  file with the smallest time stamp, the failed rank that recorded the earliest failure
  (:func:`record_failure`, into the file :data:`FAILURES_VARIABLE` names), else the first
  failed rank the loop saw;
* one stop (:meth:`Ranks.stop`): SIGTERM to each rank, ``grace`` seconds, then SIGKILL to
  everything below it, found by process tree and by a marker variable that every process
  of the group inherits (:data:`LAUNCH_ID_VARIABLE`; it survives re-parenting), then a
  reap bounded by :data:`REAP_S`, as torch bounds it (a rank stuck in the kernel cannot
  be reaped: it is named in the errors and left, not waited for);
* one result, :class:`Ended`.
torch's ``torch.distributed.elastic.multiprocessing.start_processes`` (``PContext``) is the
model: it too starts ranks, tails their logs and closes them with a signal and a timeout.
It does not fit as the runner: it starts one fixed set of processes at once (a node that
joins later, or a store started before the nodes, is a second context), it has no way to
signal one rank's tree on purpose (a lost node), its echo prefixes every line with the
rank and writes to this process's file descriptor 1 (which is not a notebook cell's
output), and a function entrypoint is started with a fresh ``spawn`` or the caller's
forkserver without the rank's own environment and log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ddpguide.core import scratch
from ddpguide.core.processes import alive, descendants, processes_with_env, signal_all
from ddpguide.launch import starts
from ddpguide.launch.ended import Ended, Outcome, RankEnd
from ddpguide.launch.rank_files import FAILURES_VARIABLE, Tail, recorded_failures

__all__ = ["Command", "Ended", "Forked", "Outcome", "RankEnd", "Ranks", "run"]

#: every process of one group carries ``DDPGUIDE_LAUNCH_ID=<id>`` in its environment
LAUNCH_ID_VARIABLE = "DDPGUIDE_LAUNCH_ID"
POLL_S = 0.05
#: how long a rank may take to end after SIGTERM before it is killed (torch's agent: 30 s)
GRACE_S = 5.0
#: how long the group waits, in all, to reap its ranks after SIGKILL
REAP_S = 10.0
_START_LOCK = threading.Lock()


@dataclass(frozen=True)
class Command:
    """A rank exec'd: ``[*prefix, *argv]`` in ``cwd``, with ``env`` over this process's
    environment (over ``base_env`` instead when given); output to ``log`` (None: the
    group's output) and error output to ``errors`` (None: the same as the output)."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | os.PathLike | None = None
    prefix: Sequence[str] = ()
    name: str = ""
    base_env: Mapping[str, str] | None = None
    log: str | os.PathLike | None = None
    errors: str | os.PathLike | None = None


@dataclass(frozen=True)
class Forked:
    """A rank forked warm: ``target(*args)`` with exactly ``environ`` as its environment."""

    target: Callable[..., Any]
    args: tuple = ()
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    name: str = ""
    log: str | os.PathLike | None = None
    errors: str | os.PathLike | None = None
    #: variables the rank applies itself, so they never force a fresh interpreter
    set_by_the_rank: frozenset[str] = frozenset()


class Ranks:
    """A group of ranks on this machine; closing it (``with``) stops whatever is left."""

    def __init__(self, echo: Callable[[str], None] | None = None, separate_errors: bool = False,
                 workdir: str | os.PathLike | None = None):
        self.launch_id = uuid.uuid4().hex
        self._own = workdir is None
        self.workdir = Path(workdir or scratch.folder("ddpguide-ranks-"))
        self.output_path = self.workdir / "output.txt"
        self.errors_path = self.workdir / "errors.txt" if separate_errors else self.output_path
        self.output_path.touch()
        self.tail = Tail(echo)
        self.tail.add(self.output_path)
        self.failures_path = self.workdir / "failures.txt"
        self.processes: list[Any] = []  # subprocess.Popen or multiprocessing.Process
        self.names: list[str] = []
        self.logs: list[tuple[Path, Path]] = []  # each rank's output and error output
        self._seen_failure: int | None = None
        self.unreaped: tuple[int, ...] = ()
        self.stopped: set[int] = set()  # the ranks still running when stop() began
        self.started = time.monotonic()

    def start(self, rank: Command | Forked) -> int:
        """Start one rank now; returns its index in the group."""
        log = Path(rank.log) if rank.log else self.output_path
        errors = Path(rank.errors) if rank.errors else (log if rank.log else self.errors_path)
        for path in (log, errors):  # the same file twice is added once
            self.tail.add(path)
        if isinstance(rank, Command):
            env = {**(os.environ if rank.base_env is None else rank.base_env), **rank.env,
                   **self._marks()}
            starts.record(rank.argv, rank.cwd, env)  # for the check that programs ran as typed
            with open(log, "ab") as out, open(errors, "ab") as err:
                process: Any = subprocess.Popen(
                    [*rank.prefix, *rank.argv], cwd=rank.cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT if errors == log else err,
                    start_new_session=True)
        else:
            from ddpguide.launch import warm

            environ = {**rank.environ, **self._marks()}
            ctx = warm.context(environ, rank.set_by_the_rank)
            start = warm.WarmStart(environ, str(log), str(errors) if errors != log else None)
            process = ctx.Process(target=warm.forked_entry, args=(start, rank.target, rank.args),
                                  name=rank.name or f"rank{len(self.processes)}")
            with _START_LOCK, warm.exec_time_environment(
                    {k: v for k, v in environ.items() if k != LAUNCH_ID_VARIABLE}, ctx.get_start_method()):
                process.start()
        self.processes.append(process)
        self.names.append(rank.name or str(len(self.names)))
        self.logs.append((log, errors))
        return len(self.processes) - 1

    def _marks(self) -> dict[str, str]:
        return {LAUNCH_ID_VARIABLE: self.launch_id, FAILURES_VARIABLE: str(self.failures_path)}

    @property
    def first_failure(self) -> int | None:
        """The failed rank that recorded the earliest failure, else the first failed rank seen
        (a rank killed, or crashed in C++, records nothing: it counts only when none did)."""
        failed = {i for i, c in enumerate(self.returncodes()) if c not in (None, 0)}
        if self._seen_failure is None or not failed:
            return None
        return next((i for i in recorded_failures(self.failures_path) if i in failed),
                    self._seen_failure)

    def returncode(self, index: int) -> int | None:
        process = self.processes[index]
        return process.poll() if isinstance(process, subprocess.Popen) else process.exitcode

    def returncodes(self) -> list[int | None]:
        return [self.returncode(i) for i in range(len(self.processes))]

    def alive(self, index: int) -> bool:
        return self.returncode(index) is None

    def pid(self, index: int) -> int:
        return int(self.processes[index].pid)

    def signal(self, index: int, sig: int = signal.SIGKILL, tree: bool = True) -> None:
        """Send ``sig`` to rank ``index`` (and to every process below it: a lost machine)."""
        pid = self.pid(index)
        if self.alive(index):
            signal_all([pid, *(descendants(pid) if tree else [])], sig)

    def wait(self, timeout: float, until: Callable[[], bool] | None = None,
             failure_grace: float = 0.0, *, all_end: bool = False) -> Outcome:
        """Tail the logs until every rank has ended (DONE, or FAILED if one failed), one failed
        and the others had ``failure_grace`` s (FAILED; not with ``all_end``: then a failure
        ends nothing), ``until()`` holds (UNTIL) or ``timeout`` s have passed (TIMEOUT).
        Nothing is stopped here."""
        deadline = time.monotonic() + timeout
        failed_at = None if self._seen_failure is None else time.monotonic()
        while True:
            self.tail.poll()
            codes = self.returncodes()  # before the failure check: no race with a late exit
            if self._seen_failure is None:
                self._seen_failure = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            now = time.monotonic()
            if self._seen_failure is not None and failed_at is None:
                failed_at = now
            if all(c is not None for c in codes):
                return Outcome.FAILED if self._seen_failure is not None else Outcome.DONE
            if not all_end and failed_at is not None and now >= failed_at + failure_grace:
                return Outcome.FAILED
            if until is not None and until():
                return Outcome.UNTIL
            if now >= deadline:
                return Outcome.TIMEOUT
            time.sleep(POLL_S)

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM every running rank, SIGKILL all that is left of the group after ``grace`` s."""
        running = [i for i in range(len(self.processes)) if self.alive(i)]
        self.stopped.update(running)
        trees = {pid for i in running for pid in (self.pid(i), *descendants(self.pid(i)))}
        if grace > 0:
            for i in running:
                self.signal(i, signal.SIGTERM, tree=False)  # a torchrun agent forwards it
            deadline = time.monotonic() + grace
            while any(self.alive(i) for i in running) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        deadline = time.monotonic() + 15.0  # a process may fork while we look: look again
        while time.monotonic() < deadline:
            left = [p for p in trees | {*processes_with_env(LAUNCH_ID_VARIABLE, self.launch_id)}
                    if alive(p)]
            if not left:
                break
            signal_all(left, signal.SIGKILL)
            trees = set(left)
            time.sleep(POLL_S)
        self._reap(time.monotonic() + REAP_S)
        self.tail.poll(final=True)

    def _reap(self, deadline: float) -> None:
        """Reap every rank by ``deadline``; one that cannot be (stuck in the kernel) is named in
        the errors and left behind, as torch's agent abandons it, so that stopping never hangs."""
        for process in self.processes:
            left = max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(left) if isinstance(process, subprocess.Popen) else process.join(left)
        stuck = tuple(i for i in range(len(self.processes)) if self.alive(i))
        with open(self.errors_path, "a") as log:
            for i in set(stuck) - set(self.unreaped):
                log.write(f"rank {self.names[i]} (pid {self.pid(i)}) was not reaped within "
                          f"{REAP_S:g} s of SIGKILL (stuck in the kernel?): left behind\n")
        self.unreaped = stuck

    def ended(self, timed_out: bool = False, failed_status: int | None = None) -> Ended:
        """The group's :class:`Ended` (call after :meth:`stop`)."""
        errors = self.tail.text(self.errors_path) if self.errors_path != self.output_path else None
        codes = [None if i in self.stopped else c for i, c in enumerate(self.returncodes())]
        each = [RankEnd(name, code, self.tail.text(log), self.tail.text(err) if err != log else "")
                for name, code, (log, err) in zip(self.names, codes, self.logs, strict=True)]
        return Ended(codes, self.tail.text(self.output_path), timed_out, self.first_failure,
                     time.monotonic() - self.started, errors, self.unreaped, failed_status, each)

    def close(self) -> None:
        self.stop(grace=0.0)
        if self._own:
            scratch.remove(self.workdir)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(ranks: Sequence[Command | Forked], timeout: float, echo: Callable[[str], None] | None = None,
        failure_grace: float = GRACE_S, separate_errors: bool = False) -> Ended:
    """Start ``ranks``, wait at most ``timeout`` s, stop the others ``failure_grace`` s after
    the first failure, and return how they ended; nothing of the group is left running."""
    with Ranks(echo, separate_errors) as group:
        for rank in ranks:
            group.start(rank)
        outcome = group.wait(timeout, failure_grace=failure_grace)
        group.stop(grace=0.0 if outcome is Outcome.TIMEOUT else GRACE_S)
        return group.ended(timed_out=outcome is Outcome.TIMEOUT)
