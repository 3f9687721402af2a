"""``ddpguide.cluster.processes.run_all``: one failure or the deadline stops every tree."""

from __future__ import annotations

import sys
import time

import pytest

from ddpguide.cluster.processes import run_all
from ddpguide.core.processes import alive

pytestmark = pytest.mark.multiprocess

SLEEPER = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
# The sleeper, and a marker file once it has printed its pid; a command that starts with
# AFTER_SLEEPER waits (10 s at most) for that file, so the sleeper is up when it ends.
READY_SLEEPER = [sys.executable, "-c", "import os, pathlib, time; print(os.getpid(), flush=True); "
                 "pathlib.Path('sleeper.up').touch(); time.sleep(60)"]
AFTER_SLEEPER = ("import pathlib, sys, time\n"
                 "for _ in range(1000):\n"
                 "    if pathlib.Path('sleeper.up').exists():\n"
                 "        break\n"
                 "    time.sleep(0.01)\n")


def test_a_failure_stops_the_others_and_a_success_is_reported(tmp_path):
    started = time.monotonic()
    ok, bad, slow = run_all([[sys.executable, "-c", "print('hi')"],
                             [sys.executable, "-c", AFTER_SLEEPER + "sys.exit(3)"],
                             READY_SLEEPER], timeout=30, cwd=tmp_path)
    assert (ok.returncode, ok.output) == (0, "hi\n")
    assert bad.returncode == 3 and slow.returncode is None
    assert time.monotonic() - started < 15 and not alive(int(slow.output.split()[0]))


def test_the_deadline_stops_a_tree():
    nested = [sys.executable, "-c", "import subprocess, sys; "
              f"subprocess.run({SLEEPER!r})"]
    [done] = run_all([nested], timeout=1.5)
    assert done.returncode is None and not alive(int(done.output.split()[0]))


def test_until_sees_the_statuses_and_its_true_stops_the_rest(tmp_path):
    seen = []

    def first_done(codes):
        seen.append(list(codes))
        return codes[0] is not None
    started = time.monotonic()
    quick, slow = run_all([[sys.executable, "-c", AFTER_SLEEPER + "print('hi')"], READY_SLEEPER],
                          timeout=30, cwd=tmp_path, fail_fast=False, until=first_done)
    assert (quick.returncode, slow.returncode) == (0, None)
    assert seen[-1] == [0, None]  # the sleeper still ran when until said stop
    assert time.monotonic() - started < 15 and not alive(int(slow.output.split()[0]))
