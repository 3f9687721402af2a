"""The reaper kills every process of a launch once the process it watches has died."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from ddpguide.launch.ranks import LAUNCH_ID_VARIABLE


@pytest.mark.multiprocess
def test_the_marked_processes_die_after_the_watched_one():
    env = {**os.environ, LAUNCH_ID_VARIABLE: "reaper-test", "PYTHONPATH": os.pathsep.join(sys.path)}
    watched = subprocess.Popen(["sleep", "1"])
    marked = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        reaper = subprocess.Popen([sys.executable, "-m", "ddpguide.failures.reaper",
                                   str(watched.pid), "reaper-test"], env=env)
        watched.wait(10)
        assert reaper.wait(30) == 0
        assert marked.wait(10) == -9
        assert other.poll() is None and psutil.pid_exists(other.pid)
    finally:
        for p in (marked, other):
            p.kill()
            p.wait(10)
