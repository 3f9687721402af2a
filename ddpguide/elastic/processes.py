"""Process lifetime on Linux: nobody outlives the process that started it.

torchrun starts every worker in a session of its own, so killing an agent's
process group does not reach its workers, and a killed agent leaves them
running (and holding their ports). Each process of an elastic job here asks
the kernel to kill it when its parent dies; the demo's orchestrator also
kills whole process trees.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
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
