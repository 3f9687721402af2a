"""The one runner: start ranks, watch them against a deadline, stop them, say how they ended.

Every process the package starts for a lesson or a check goes through :class:`Ranks`:

* a rank is a :class:`Command` (exec'd, in a session of its own, optionally under a
  ``prefix`` such as ``ip netns exec NODE``) or a :class:`Forked` call (a function run in a
  process forked from the warm server of :mod:`ddpguide.launch.warm`);
* every rank writes to a log file (by default the group's one shared output, as
  torchrun's workers share its terminal); one tail reads the logs as they grow and
  echoes whole lines only;
* one deadline loop (:meth:`Ranks.wait`) with one first-failure rule: the first rank seen
  to exit with a status other than 0 is the failure, and the others get ``failure_grace``
  seconds to notice and end on their own;
* one stop (:meth:`Ranks.stop`): SIGTERM to each rank, ``grace`` seconds, then SIGKILL to
  everything below it, found by process tree and by a marker variable that every process
  of the group inherits (:data:`LAUNCH_ID_VARIABLE`; it survives re-parenting);
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
from ddpguide.core.processes import alive, descendants, die_with_parent, processes_with_env, signal_all

#: every process of one group carries ``DDPGUIDE_LAUNCH_ID=<id>`` in its environment
LAUNCH_ID_VARIABLE = "DDPGUIDE_LAUNCH_ID"
POLL_S = 0.05
#: how long a rank may take to end after SIGTERM before it is killed (torch's agent: 30 s)
GRACE_S = 5.0
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


@dataclass
class Ended:
    """How a group ended: each rank's status (None: still running when stopped at the
    deadline), the group's output (and error output when kept apart), the first rank that
    failed, and the wall time."""

    returncodes: list[int | None]
    output: str
    timed_out: bool
    first_failure: int | None
    seconds: float
    errors: str | None = None

    @property
    def returncode(self) -> int:
        """One status for the group: the failed rank's, -9 at the deadline, else 0."""
        if self.timed_out:
            return -9
        return int(self.returncodes[self.first_failure] or 1) if self.first_failure is not None else 0


class Tail:
    """Log files read as they grow; ``echo`` gets whole lines only (the rest on ``final``)."""

    def __init__(self, echo: Callable[[str], None] | None = None):
        self.echo = echo
        self.paths: list[Path] = []
        self._data: dict[Path, bytearray] = {}
        self._shown: dict[Path, int] = {}

    def add(self, path: Path) -> None:
        if path not in self._data:
            self.paths.append(path)
            self._data[path], self._shown[path] = bytearray(), 0

    def poll(self, final: bool = False) -> None:
        for path in self.paths:
            data = self._data[path]
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(len(data))
                data += f.read()
            end = len(data) if final else data.rfind(b"\n") + 1
            if self.echo is not None and end > self._shown[path]:
                self.echo(bytes(data[self._shown[path]:end]).decode(errors="replace"))
            self._shown[path] = max(end, self._shown[path])

    def text(self, path: Path) -> str:
        return bytes(self._data.get(path, b"")).decode(errors="replace")


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
        self.processes: list[Any] = []  # subprocess.Popen or multiprocessing.Process
        self.names: list[str] = []
        self.first_failure: int | None = None
        self.started = time.monotonic()

    def start(self, rank: Command | Forked) -> int:
        """Start one rank now; returns its index in the group."""
        log = Path(rank.log) if rank.log else self.output_path
        errors = Path(rank.errors) if rank.errors else (log if rank.log else self.errors_path)
        for path in (log, errors):  # the same file twice is added once
            self.tail.add(path)
        if isinstance(rank, Command):
            env = {**(os.environ if rank.base_env is None else rank.base_env), **rank.env,
                   LAUNCH_ID_VARIABLE: self.launch_id}
            with open(log, "ab") as out, open(errors, "ab") as err:
                process: Any = subprocess.Popen(
                    [*rank.prefix, *rank.argv], cwd=rank.cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT if errors == log else err,
                    start_new_session=True)
        else:
            from ddpguide.launch import warm

            environ = {**rank.environ, LAUNCH_ID_VARIABLE: self.launch_id}
            ctx = warm.context(environ, rank.set_by_the_rank)
            start = warm.WarmStart(environ, str(log), str(errors) if errors != log else None)
            process = ctx.Process(target=forked_entry, args=(start, rank.target, rank.args),
                                  name=rank.name or f"rank{len(self.processes)}")
            with _START_LOCK, _exec_time_environment(environ, ctx.get_start_method()):
                process.start()
        self.processes.append(process)
        self.names.append(rank.name or str(len(self.names)))
        return len(self.processes) - 1

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
             failure_grace: float = 0.0) -> str:
        """Tail the logs until every rank has ended (``"done"``), one failed and the others
        had ``failure_grace`` s (``"failed"``), ``until()`` holds (``"until"``) or ``timeout``
        s have passed (``"timeout"``). Nothing is stopped here."""
        deadline = time.monotonic() + timeout
        failed_at = None if self.first_failure is None else time.monotonic()
        while True:
            self.tail.poll()
            codes = self.returncodes()  # before the failure check: no race with a late exit
            if self.first_failure is None:
                self.first_failure = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            now = time.monotonic()
            if self.first_failure is not None and failed_at is None:
                failed_at = now
            if all(c is not None for c in codes):
                return "failed" if self.first_failure is not None else "done"
            if failed_at is not None and now >= failed_at + failure_grace:
                return "failed"
            if until is not None and until():
                return "until"
            if now >= deadline:
                return "timeout"
            time.sleep(POLL_S)

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM every running rank, SIGKILL all that is left of the group after ``grace`` s."""
        running = [i for i in range(len(self.processes)) if self.alive(i)]
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
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.wait() if isinstance(process, subprocess.Popen) else process.join()
        self.tail.poll(final=True)

    def ended(self, timed_out: bool = False) -> Ended:
        """The group's :class:`Ended` (call after :meth:`stop`)."""
        errors = self.tail.text(self.errors_path) if self.errors_path != self.output_path else None
        return Ended(self.returncodes(), self.tail.text(self.output_path), timed_out,
                     self.first_failure, time.monotonic() - self.started, errors)

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
        group.stop(grace=0.0 if outcome == "timeout" else GRACE_S)
        return group.ended(timed_out=outcome == "timeout")


def forked_entry(start: Any, target: Callable[..., Any], args: tuple) -> None:
    """A forked rank's first steps: its own environment and log, death with its parent."""
    start.apply()
    die_with_parent()
    target(*args)


@contextlib.contextmanager
def _exec_time_environment(environ: Mapping[str, str], method: str):
    """For a rank that must be a fresh interpreter (``spawn``), the variables only an
    interpreter's start reads are this process's while it starts the rank."""
    if method == "forkserver":
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # started now, it does not carry the rank's variables
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in environ.items() if k != LAUNCH_ID_VARIABLE})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
