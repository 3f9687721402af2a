"""Failures from outside the program: chosen by pid from the process tree the engine started,
at moments drawn from a seed, each logged with its wall time (and, after the run, the step
it landed in).

Kinds: ``kill`` (SIGKILL of a random rank), ``segv`` (SIGSEGV), ``term`` (SIGTERM: the rank
ends by the default action, its sockets closed by the kernel, as a rank does that exits on
an error), ``hang`` (SIGSTOP past the timeouts, then SIGKILL or SIGCONT), ``lighthouse``
(killed, started again at the same address), ``heal`` (a rank killed, then its replacement
killed as soon as it has started, while it joins and heals), ``donor`` (a rank killed, then,
while its replacement heals, the rank of another group that serves it the checkpoint: seen
from outside as the replacement's connection to one of that rank's torchft servers,
:mod:`.sockets`; three groups or more, so that a third holds the state), ``quorum`` (a rank killed just
after a step, while the next quorum forms), ``two`` (a rank of each of two groups at once; three groups or more),
``link`` (on a cluster only: the link of a group's node taken down, past the timeouts, then
brought back up; never node 0's, which holds the lighthouse).

A cut link is restored rather than left dead: with its link down a group reaches neither the
lighthouse nor its peers, so every process torchrun started in its place would fail the same
way and use up its restarts; a link that comes back (a flapping cable, a rebooted switch) is
what a group can recover from. Its processes are not killed: they fail their collective or
quorum on their own, join the next quorum once the link is back and heal from a live peer
(or exit on the error and are restarted by torchrun, which heals them the same way).
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

from ddpguide.core.processes import signal_all
from ddpguide.failures import engine, sockets

KINDS = ("kill", "segv", "hang", "lighthouse", "heal", "quorum", "two", "term", "link", "donor")
#: the failure entries a stopped peer leaves the survivors (they wait for it, no socket closed)
SILENT = ("SIGSTOP", "link down")


class Chaos:
    """Failures injected into a running :class:`engine.Job`, one after the other."""

    def __init__(self, job: engine.Job, seed: int, kinds: tuple[str, ...] = KINDS,
                 gap_s: tuple[float, float] = (1.0, 3.0), in_order: bool = False,
                 hang_ends: tuple[signal.Signals, ...] = (signal.SIGKILL, signal.SIGCONT),
                 before: Callable[[str], dict] | None = None,
                 after: Callable[[str], dict] | None = None):
        self.job, self.rng, self.gap_s, self.in_order = job, random.Random(seed), gap_s, in_order
        self.hang_ends = hang_ends     # what ends a hang: drawn from these
        self.before = before           # called with the kind just before each failure: its
        self._extra: dict = {}         # keys go into that failure's log entries
        self.after = after             # the same, called once every group is back after it
        self._pending: tuple[int, str] | None = None   # (first log entry, kind) awaiting it
        self.kinds = tuple(k for k in kinds if (k not in ("two", "donor") or job.settings.groups >= 3)
                           and (k != "link" or job.cluster is not None))
        self.log: list[dict] = []

    def rows(self) -> list[dict]:
        return engine.read_rows(self.job.folder)

    def _rank(self, group: int, until_s: float) -> int | None:
        """A random rank's pid of ``group``, once torchrun has started it."""
        while time.monotonic() < until_s:
            pids = self.job.ranks_of(group)
            if len(pids) == self.job.settings.group_size:
                return self.rng.choice(sorted(pids))
            time.sleep(0.05)
        return None

    def _note(self, what: str, groups: list[int], pids: list[int], **more: object) -> None:
        self.log.append({"what": what, "groups": groups, "pids": pids, "time": time.time(),
                         **self._extra, **more})

    def _healthy(self) -> bool:
        """Every group has committed a step since the last failure (it is back and working)."""
        since = self.log[-1]["time"] if self.log else 0.0
        committed = {r["group"] for r in self.rows() if r["event"] in ("step", "sync")
                     and r["committed"] and r["time"] > since}
        return committed == set(range(self.job.settings.groups))

    def _near_the_end(self, margin: int) -> bool:
        steps = [r["step"] for r in self.rows() if r["event"] in ("step", "sync")]
        return max(steps, default=0) >= self.job.settings.steps - margin

    def run(self, failures: int, until_s: float, margin: int) -> list[dict]:
        """Inject ``failures`` failures (fewer if the run nears its end or ``until_s``): kinds
        drawn at random, or taken in turn (``in_order``)."""
        for i in range(failures):
            while not self._healthy():
                if time.monotonic() > until_s or not self.job.running():
                    return self.log
                time.sleep(0.05)
            self._after_last()
            time.sleep(self.rng.uniform(*self.gap_s))
            if self._near_the_end(margin) or time.monotonic() > until_s:
                break
            kind = self.kinds[i % len(self.kinds)] if self.in_order else self.rng.choice(self.kinds)
            self._extra = self.before(kind) if self.before else {}
            self._pending = (len(self.log), kind)
            self.inject(kind, until_s)
        return self.log

    def _after_last(self) -> None:
        """``after(kind)`` for the last failure, once its group is back; its keys go into that
        failure's entries."""
        if self.after is not None and self._pending is not None:
            first, kind = self._pending
            extra = self.after(kind)
            for entry in self.log[first:]:
                entry.update(extra)
        self._pending = None

    def end_soon(self, until_s: float, margin: int) -> None:
        """Once every group is back (or at ``until_s``), end the run ``margin`` steps past the
        furthest group, so that it lasts as long as its failures need and no longer."""
        while not self._healthy() and time.monotonic() < until_s and self.job.running():
            time.sleep(0.05)
        if self._healthy():
            self._after_last()
        steps = [r["step"] for r in self.rows() if r["event"] in ("step", "sync")]
        engine.stop_at(self.job.folder, max(steps, default=0) + max(margin, 2))

    def inject(self, kind: str, until_s: float) -> None:
        groups = self.job.settings.groups
        if kind == "lighthouse":
            self.job.ranks.signal(self.job.lighthouse, signal.SIGKILL)
            self._note("lighthouse killed", [], [self.job.ranks.pid(self.job.lighthouse)])
            time.sleep(0.2)
            self.job.start_lighthouse()      # the same port: the Managers retry their quorum
            return
        victims = self.rng.sample(range(1 if kind == "link" else 0, groups),
                                  2 if kind == "two" else 1)
        if kind == "link":
            pids = self.job.ranks_of(victims[0])
            try:
                self.job.set_link(victims[0], up=False)
                self._note("link down", victims, pids)
                time.sleep(self.job.settings.timeout_s + 1.0)   # past every timeout
            finally:
                self.job.set_link(victims[0], up=True)
            self._note("link up", victims, pids, after="link down")
            return
        pids = [p for p in (self._rank(g, until_s) for g in victims) if p is not None]
        if kind == "quorum":                 # just after a step: the next quorum is forming
            seen = len(self.rows())
            while time.monotonic() < until_s and not any(
                    r["event"] == "step" and r["group"] == victims[0]
                    for r in self.rows()[seen:]):
                time.sleep(0.01)
        if kind == "hang":
            signal_all(pids, signal.SIGSTOP)
            self._note("SIGSTOP", victims, pids)
            time.sleep(self.job.settings.timeout_s + 1.0)   # past every timeout
            sig = self.rng.choice(self.hang_ends)
            signal_all(pids, sig)
            self._note(signal.Signals(sig).name, victims, pids, after="SIGSTOP")
            return
        sig = {"segv": signal.SIGSEGV, "term": signal.SIGTERM}.get(kind, signal.SIGKILL)
        signal_all(pids, sig)
        self._note(f"{signal.Signals(sig).name} ({kind})", victims, pids)
        if kind == "donor":
            self._kill_the_donor(victims[0], set(pids), until_s)
        if kind == "heal":                   # the replacement, while it joins and heals
            before = {p for g in victims for p in self.job.ranks_of(g)}
            while time.monotonic() < until_s:
                rows = self.rows()
                started = [r for r in rows if r["event"] == "started" and r["group"] == victims[0]
                           and r["time"] > self.log[-1]["time"]]
                if started:
                    pid = started[0]["pid"]
                    if pid not in before:
                        signal_all([pid], signal.SIGKILL)
                        self._note("SIGKILL (while healing)", victims, [pid])
                    return
                time.sleep(0.01)

    def _kill_the_donor(self, victim: int, killed: set[int], until_s: float) -> None:
        """Once ``victim``'s replacement is connected to a torchft server (the Manager's or the
        checkpoint's, at ``[::]``) of a rank of another group, that rank is serving it a heal:
        SIGKILL it. Nothing more if the replacement has healed before it was seen connected."""
        ports = {port: pid for g in range(self.job.settings.groups) if g != victim
                 for pid in self.job.ranks_of(g) for port in sockets.servers(pid)}
        group_of = {pid: g for g in range(self.job.settings.groups)
                    for pid in self.job.ranks_of(g)}
        since, looked = self.log[-1]["time"], 0.0
        while time.monotonic() < until_s:
            for pid in set(self.job.ranks_of(victim)) - killed:
                donor = sockets.connected_to(pid, ports)
                if donor is not None:
                    signal_all([donor], signal.SIGKILL)
                    self._note("SIGKILL (donor serving a heal)", [group_of[donor]], [donor],
                               healing=[victim])
                    return
            if time.monotonic() - looked > 0.2:   # the rows: slower to read than the sockets
                looked = time.monotonic()
                if any(r["event"] == "healed" and r["group"] == victim and r["time"] > since
                       for r in self.rows()):
                    return
            time.sleep(0.002)


def landed(failures: list[dict], rows: list[dict]) -> list[dict]:
    """Each failure with the step it landed in: the last step any rank had begun by then."""
    out = []
    for failure in failures:
        begun = [r["step"] for r in rows if r["event"] == "contributed" and r["time"] <= failure["time"]]
        out.append({**failure, "step": max(begun, default=0)})
    return out
