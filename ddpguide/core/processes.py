"""Process plumbing, written once: ports, process trees, lifetimes and exits.

torchrun starts every worker in a session of its own, so killing an agent's
process group does not reach its workers, and a killed agent leaves them
running (and holding their ports). Processes here ask the kernel to kill them
when their parent dies (:func:`die_with_parent`); launchers find what is left
by tree (:func:`descendants`) or by a marker in the environment
(:func:`processes_with_env`) and kill it (:func:`signal_all`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import sys
from pathlib import Path

DIE_WITH_PARENT_ENV = "DDPGUIDE_DIE_WITH_PARENT"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have Linux send ``sig`` to this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to every pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment holds ``name=value`` (Linux /proc; else empty).

    An environment variable survives re-parenting: a worker whose agent was
    killed is still found.
    """
    marker = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def exit_now(code: int) -> None:
    """Flush stdout and stderr, then leave without interpreter teardown.

    gloo's background threads can make the C++ runtime abort during normal
    interpreter shutdown ("terminate called without an active exception"), so
    a worker that has written everything that matters leaves at once.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def ephemeral_port(host: str = "127.0.0.1") -> int:
    """A TCP port the operating system just handed out (bind to port 0), for a
    server this process starts at once; another program may take it later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def store_port() -> int:
    """A port nobody listens on, for a store that another process binds seconds later.

    It is drawn below the kernel's ephemeral range: outgoing connections of
    other programs take their ports from that range and could grab an
    ephemeral pick before the store has started.
    """
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randint(20000, max(20001, first - 1))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    return ephemeral_port()
