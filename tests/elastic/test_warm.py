"""Node mode's forkserver (``ddpguide.launch.warm.start``): it imports what every forked
worker needs, checks that it can be forked from, and dies with its agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpguide.core.processes import alive, signal_all

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import importlib, sys, time
from ddpguide.elastic.node import PRELOAD
for name in PRELOAD:
    importlib.import_module(name)
import ddpguide.launch.warm as warm  # last, as the server imports it
print("ready", warm.check_forkable(), flush=True)
time.sleep(60)
"""
AGENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]],
                         env={**os.environ, "DDPGUIDE_WARM_PARENT": str(os.getpid())})
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.parametrize("strategy, extra", [
    ("ddp", []),
    ("fsdp", ["ddpguide.sharding.fsdp_strategy"]),
])
def test_node_mode_preloads_the_worker_and_the_warm_module_last(monkeypatch, strategy, extra):
    import multiprocessing
    from multiprocessing import forkserver

    from ddpguide.elastic import node

    preloaded: list[list[str]] = []
    seen: list[str | None] = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloaded.append)
    monkeypatch.setattr(forkserver, "ensure_running",  # start nothing
                        lambda: seen.append(os.environ.get("DDPGUIDE_WARM_PARENT")))
    node._start_forkserver(strategy)
    assert preloaded == [[*node.PRELOAD, *extra, "ddpguide.launch.warm"]]
    assert seen == [str(os.getpid())] and "DDPGUIDE_WARM_PARENT" not in os.environ


@pytest.mark.timeout(90)
def test_it_imports_the_workers_needs_and_dies_with_its_agent():
    """The "agent" here is a plain process; killing it must take its forkserver along."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT, CHILD], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, start_new_session=True)
    child = None
    try:
        child = int(agent.stdout.readline())
        assert agent.stdout.readline() == "ready []\n"  # one thread, no CUDA context
        agent.kill()
        agent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the forkserver outlived its agent"
    finally:
        signal_all([p for p in (agent.pid, child) if p], signal.SIGKILL)
        agent.wait(10)
