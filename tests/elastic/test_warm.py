"""The forkserver's start-up module (``ddpguide.elastic.warm``): node mode preloads it,
it imports what every forked worker needs, and it dies with its agent."""

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
import sys, time
import ddpguide.elastic.warm as warm
wanted = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
          "ddpguide.elastic.worker", "ddpguide.train.loop"]
print("ready", warm.AGENT_PID_ENV, [m for m in wanted if m not in sys.modules], flush=True)
time.sleep(60)
"""
AGENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]],
                         env={**os.environ, "DDPGUIDE_AGENT_PID": str(os.getpid())})
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.parametrize("strategy, modules", [
    ("ddp", ["ddpguide.elastic.warm"]),
    ("fsdp", ["ddpguide.elastic.warm", "ddpguide.sharding.fsdp_strategy"]),
])
def test_node_mode_preloads_this_module(monkeypatch, strategy, modules):
    import multiprocessing
    from multiprocessing import forkserver

    from ddpguide.elastic import node

    preloaded: list[list[str]] = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", preloaded.append)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)  # start nothing
    monkeypatch.setenv("DDPGUIDE_AGENT_PID", "")
    node._start_forkserver(strategy)
    assert preloaded == [modules]
    assert os.environ["DDPGUIDE_AGENT_PID"] == str(os.getpid())


@pytest.mark.timeout(90)
def test_it_imports_the_workers_needs_and_dies_with_its_agent():
    """The "agent" here is a plain process; killing it must take its forkserver along."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT, CHILD], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, start_new_session=True)
    child = None
    try:
        child = int(agent.stdout.readline())
        assert agent.stdout.readline().split(maxsplit=1) == ["ready", "DDPGUIDE_AGENT_PID []\n"]
        agent.kill()
        agent.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the forkserver outlived its agent"
    finally:
        signal_all([p for p in (agent.pid, child) if p], signal.SIGKILL)
        agent.wait(10)
