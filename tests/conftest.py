"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import time

import psutil
import pytest


def _children() -> dict[int, str]:
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            # multiprocessing's resource tracker lives as long as the test session.
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmdline:
                out[child.pid] = cmdline[:200]
        except psutil.Error:
            continue
    return out


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test whose child processes are still alive 5 s after it ends."""
    before = set(_children())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leftover = {pid: cmd for pid, cmd in _children().items() if pid not in before}
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in leftover:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not leftover, f"test left processes running: {leftover}"
