"""Reaching the rendezvous endpoint and meeting the other ranks, never longer than a deadline.

Before any process group exists the ranks talk through the rendezvous store
(a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, hosted by rank 0 or by
torchrun's agent). :class:`Board` uses it as a notice board: each rank pins its
record, rank 0 pins its verdict and the final report. Every wait polls with
``check`` until a deadline, so a missing rank shows up as a missing key
instead of a store call that blocks.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from typing import Any, Mapping

import torch.distributed as dist

from ddpguide.doctor.facts import Identity

_POLL_S = 0.05


class RendezvousError(RuntimeError):
    """The endpoint cannot be reached, or the store cannot be started or read."""


def check_resolves(addr: str, port: int) -> None:
    """Raise :class:`RendezvousError` naming ``addr`` when it does not resolve.

    Rank 0 calls it before it starts the store: a store on a name that does not
    resolve fails deep in C++, with a page of stack frames instead of the host's name.
    """
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise RendezvousError(f"MASTER_ADDR={addr} does not resolve ({error.strerror})") from None


def wait_for_endpoint(addr: str, port: int, deadline: float, timeout_s: float) -> float:
    """Connect to ``addr:port`` until it answers or ``deadline`` (time.monotonic) passes.

    ``timeout_s`` is the budget the deadline stands for (the message names it).
    Returns the milliseconds the successful connect took. Raises
    :class:`RendezvousError` saying why the last attempt failed.
    """
    check_resolves(addr, port)
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        started = time.perf_counter()
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, remaining))):
                return 1e3 * (time.perf_counter() - started)
        except OSError as error:
            last = error.strerror or type(error).__name__
        if time.monotonic() + _POLL_S > deadline:
            raise RendezvousError(f"nothing answered at MASTER_ADDR:MASTER_PORT={addr}:{port} "
                                  f"within {timeout_s:g} s ({last.lower()}); "
                                  "is rank 0 running, with the same MASTER_PORT?")
        time.sleep(_POLL_S * 2)


def host_store(identity: Identity, timeout_s: float) -> dist.TCPStore:
    """Rank 0 starts the store server on MASTER_PORT (as ``env://`` does without an agent)."""
    try:
        return dist.TCPStore(identity.master_addr, identity.master_port, is_master=True,
                             wait_for_workers=False, multi_tenant=True,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # DistNetworkError: address in use, no such interface, ...
        reason = str(error).splitlines()[0]
        raise RendezvousError(f"cannot start the rendezvous store on MASTER_PORT="
                              f"{identity.master_port}: {reason}") from None


def join_store(identity: Identity, timeout_s: float) -> dist.TCPStore:
    """A client of the store (call :func:`wait_for_endpoint` first: it fails quietly)."""
    try:
        return dist.TCPStore(identity.master_addr, identity.master_port, is_master=False,
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as error:
        raise RendezvousError(f"{identity.master_addr}:{identity.master_port} accepts "
                              f"connections but is not a rendezvous store: "
                              f"{str(error).splitlines()[0]}") from None


def key_prefix(environ: Mapping[str, str]) -> str:
    """Keys of this run only: torchrun's store outlives restarts and serves other users."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"ddpguide-doctor/{run_id}/{restart}/"


class Board:
    """The rendezvous store as a notice board with deadlines."""

    def __init__(self, store: dist.Store, prefix: str):
        self.store = store
        self.prefix = prefix

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _call(self, what: str, function, *args):
        try:
            return function(*args)
        except Exception as error:  # the server (rank 0 or the agent) is gone
            raise RendezvousError(f"lost the rendezvous store while {what}: "
                                  f"{str(error).splitlines()[0]}") from None

    def register(self, rank: int, record: dict[str, Any]) -> None:
        """Pin this rank's record; a second process with the same RANK gets its own slot."""
        slot = self._call("registering", self.store.add, self._key(f"count/{rank}"), 1)
        self._call("registering", self.store.set, self._key(f"facts/{rank}/{slot}"), json.dumps(record))
        self._call("registering", self.store.add, self._key("arrivals"), 1)

    def add_stray(self, rank: str, host: str, message: str) -> None:
        """A process that cannot take part (e.g. RANK >= WORLD_SIZE) leaves word for rank 0."""
        line = f"{rank}|{host}|{message}".replace("\n", " ") + "\n"
        # Store.append exists (pybind11) but torch's stub for Store leaves it out.
        self._call("leaving word", self.store.append, self._key("strays"), line)  # type: ignore[attr-defined]

    def strays(self) -> list[str]:
        """The lines :meth:`add_stray` left."""
        if not self.has("strays"):
            return []
        raw = self._call("reading", self.store.get, self._key("strays")).decode()
        return [line for line in raw.splitlines() if line]

    def has(self, name: str) -> bool:
        """Whether the key exists now (never blocks)."""
        return bool(self._call("polling", self.store.check, [self._key(name)]))

    def arrivals(self) -> int:
        """How many processes registered so far."""
        return int(self._call("counting", self.store.add, self._key("arrivals"), 0))

    def wait_for_ranks(self, world_size: int, deadline: float) -> list[int]:
        """Poll until ranks 0..world_size-1 registered or ``deadline``; the ranks that did."""
        while True:
            # The record, not the counter: register() takes its slot before it writes the
            # record, and a rank counted between the two would be reported missing.
            arrived = [r for r in range(world_size) if self.has(f"facts/{r}/1")]
            if len(arrived) == world_size or time.monotonic() > deadline:
                return arrived
            time.sleep(_POLL_S)

    def records(self, ranks: list[int]) -> list[dict[str, Any]]:
        """Every record pinned by these ranks (two for a duplicated RANK)."""
        out = []
        for rank in ranks:
            slots = int(self._call("reading", self.store.add, self._key(f"count/{rank}"), 0))
            for slot in range(1, slots + 1):
                if self.has(f"facts/{rank}/{slot}"):
                    raw = self._call("reading", self.store.get, self._key(f"facts/{rank}/{slot}"))
                    out.append(json.loads(raw))
        return out

    def post(self, name: str, value: Any) -> None:
        """Pin a JSON value under ``name``."""
        self._call("posting", self.store.set, self._key(name), json.dumps(value))

    def wait_for(self, name: str, deadline: float) -> Any | None:
        """The JSON value pinned under ``name``, or None if it is not there by ``deadline``."""
        while not self.has(name):
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        return json.loads(self._call("reading", self.store.get, self._key(name)))

    def count(self, name: str, increment: int = 1) -> int:
        """Add to a counter and return its value (0 reads it)."""
        return int(self._call("counting", self.store.add, self._key(name), increment))

    def tally(self, name: str) -> None:
        """Count one more under ``name``, leaving key ``name/N`` for the N-th (see :meth:`wait_for_tally`)."""
        self.post(f"{name}/{self.count(name)}", True)

    def wait_for_tally(self, name: str, count: int, timeout_s: float) -> bool:
        """Block until :meth:`tally` has counted ``count`` under ``name``, at most ``timeout_s``;
        whether it did. The store's own blocking ``wait``, on a client of its own: a client
        serves one call at a time, and a wait on the shared one would hold up the heartbeat."""
        if count <= 0:
            return True
        try:
            client = dist.TCPStore(self.store.host, self.store.port, is_master=False,  # type: ignore[attr-defined]
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            client.wait([self._key(f"{name}/{count}")], datetime.timedelta(seconds=timeout_s))
            return True
        except Exception:  # DistStoreError: not counted in time, or the store is gone
            return False


class Heartbeat:
    """While open, count ``beat/RANK`` up in the store every ``period_s`` (a thread).

    A rank that is stopped (SIGSTOP, a frozen host) stops beating with all its
    threads, so rank 0 can tell it from a rank that is only slow to report.
    """

    def __init__(self, board: Board, rank: int, period_s: float = 0.5):
        self.board, self.rank, self.period_s = board, rank, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.board.count(f"beat/{self.rank}")
            except RendezvousError:
                return
            self._stop.wait(self.period_s)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def wait_for_result(board: Board, rank: int, deadline: float, stale_s: float) -> tuple[Any, float]:
    """Rank ``rank``'s posted result, or None once its heartbeat has not moved for ``stale_s``
    (or at ``deadline``); with the seconds its heartbeat had been still (0.0 if it posted)."""
    last, moved = -1, time.monotonic()
    while True:
        if board.has(f"result/{rank}"):
            return board.wait_for(f"result/{rank}", deadline), 0.0
        now = time.monotonic()
        beats = board.count(f"beat/{rank}", 0)
        if beats != last:
            last, moved = beats, now
        if now - moved > stale_s or now > deadline:
            return None, now - moved
        time.sleep(_POLL_S * 2)


class RootWatch:
    """A follower's watch on rank 0: while open, a thread reads ``beat/0`` through a store
    client of its own; when the count has not moved (or the store has not replied) for
    ``limit_s``, ``on_silence(seconds, host)`` is called once (it ends the process).

    Rank 0 hosts the store, so a stopped rank 0 is a store that stops replying: the
    follower's own calls would wait for it however long torch lets them.
    """

    def __init__(self, store: dist.Store, prefix: str, limit_s: float, on_silence):
        self.board, self.limit_s, self.on_silence = Board(store, prefix), limit_s, on_silence
        self.moved, self.host = time.monotonic(), "?"
        self._stop = threading.Event()

    def _probe(self) -> None:
        last = -1
        while not self._stop.is_set():
            try:
                beats = self.board.count("beat/0", 0)
                if self.host == "?" and self.board.has("facts/0/1"):
                    self.host = self.board.records([0])[0]["host"]
            except RendezvousError:
                return
            if beats != last:
                last, self.moved = beats, time.monotonic()
            self._stop.wait(_POLL_S * 2)

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S * 2):
            if time.monotonic() - self.moved > self.limit_s:
                self.on_silence(self.limit_s, self.host)
                return

    def __enter__(self) -> RootWatch:
        for target in (self._probe, self._watch):
            threading.Thread(target=target, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
