"""The check behind every test's `no_leftover_processes` fixture."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import psutil


def live_children(ignore: Callable[[psutil.Process], bool] = lambda process: False) -> dict[int, str]:
    """Live descendants of this process (pid -> command line), minus ``ignore``d ones.

    multiprocessing's resource tracker and the warm server of
    :mod:`ddpguide.launch.warm` are always ignored: they live as long as the test
    session (the ranks forked from the server are not).
    """
    from ddpguide.launch.warm import server_pid

    out = {}
    server = server_pid()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or child.pid == server or ignore(child):
                continue
            cmdline = " ".join(child.cmdline())
            if "resource_tracker" not in cmdline:
                out[child.pid] = cmdline[:200]
        except psutil.Error:
            continue
    return out


def guard(children: Callable[[], dict[int, str]] = live_children, grace_s: float = 5.0) -> Iterator[None]:
    """Fixture body: fail the test if a process it started is alive ``grace_s`` after it ends."""
    before = set(children())
    yield
    deadline = time.monotonic() + grace_s
    while True:
        leftover = {pid: cmd for pid, cmd in children().items() if pid not in before}
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in leftover:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not leftover, f"test left processes running: {leftover}"
