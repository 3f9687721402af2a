"""A process's TCP sockets, read from outside it: the kernel's tables of its network namespace
(``/proc/PID/net/tcp`` and ``tcp6``) joined with its open files (``/proc/PID/fd``, each socket
a ``socket:[INODE]`` link). No client is needed and the process is not asked anything.

The chaos kind ``donor`` uses them to see a heal being served: a restarted rank that heals
connects to two servers of its donor's rank, both torchft's, both bound to ``[::]`` (the
Manager's server, for the checkpoint's metadata, and the ``HTTPTransport``, for the
checkpoint itself), so they are listed in the ``tcp6`` table; the ranks' gloo sockets are
bound to the interface's IPv4 address (``GLOO_SOCKET_IFNAME``) and are listed in ``tcp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LISTEN, ESTABLISHED = "0A", "01"


@dataclass(frozen=True)
class Socket:
    """One row of the kernel's table: ports, state (hex, as the kernel writes it), bytes
    waiting to be read, the socket's inode, and whether it is in the IPv6 table."""

    local_port: int
    remote_port: int
    state: str
    rx_queue: int
    inode: int
    v6: bool


def inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open (empty when it is gone)."""
    found: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def table(pid: int) -> list[Socket]:
    """Every TCP socket of ``pid``'s network namespace (every process's, not only its own)."""
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            rows.append(Socket(int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16),
                               f[3], int(f[4].split(":")[1], 16), int(f[9]), name == "tcp6"))
    return rows


def owned(pid: int) -> list[Socket]:
    """The sockets ``pid`` itself holds."""
    mine = inodes(pid)
    return [s for s in table(pid) if s.inode in mine]


def listening(pid: int, port: int) -> bool:
    """True when a socket of ``pid``'s network namespace listens on ``port``."""
    return any(s.state == LISTEN and s.local_port == port for s in table(pid))


def servers(pid: int) -> set[int]:
    """The ports ``pid`` listens on at ``[::]`` (the IPv6 table): torchft's servers in a rank."""
    return {s.local_port for s in owned(pid) if s.state == LISTEN and s.v6}


def connected_to(pid: int, ports: dict[int, int]) -> int | None:
    """Of ``ports`` (port -> the pid that listens on it), the pid that ``pid`` has an
    established connection to now, or None."""
    for s in owned(pid):
        if s.state == ESTABLISHED and s.remote_port in ports:
            return ports[s.remote_port]
    return None
