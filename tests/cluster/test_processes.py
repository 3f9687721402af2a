"""``ddpguide.cluster.processes.run_all``: one failure or the deadline stops every tree."""

from __future__ import annotations

import sys
import time

import pytest

from ddpguide.cluster.processes import run_all
from ddpguide.core.processes import alive

pytestmark = pytest.mark.multiprocess

SLEEPER = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]


def test_a_failure_stops_the_others_and_a_success_is_reported():
    started = time.monotonic()
    ok, bad, slow = run_all([[sys.executable, "-c", "print('hi')"],
                             [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(3)"],
                             SLEEPER], timeout=30)
    assert (ok.returncode, ok.stdout) == (0, "hi\n")
    assert bad.returncode == 3 and slow.returncode is None
    assert time.monotonic() - started < 15 and not alive(int(slow.stdout.split()[0]))


def test_the_deadline_stops_a_tree():
    nested = [sys.executable, "-c", "import subprocess, sys; "
              f"subprocess.run({SLEEPER!r})"]
    [done] = run_all([nested], timeout=1.5)
    assert done.returncode is None and not alive(int(done.stdout.split()[0]))


def test_until_sees_the_statuses_and_its_true_stops_the_rest():
    seen = []

    def first_done(codes):
        seen.append(list(codes))
        return codes[0] is not None
    started = time.monotonic()
    quick, slow = run_all([[sys.executable, "-c", "print('hi')"], SLEEPER], timeout=30,
                          fail_fast=False, until=first_done)
    assert (quick.returncode, slow.returncode) == (0, None)
    assert seen[-1] == [0, None]  # the sleeper still ran when until said stop
    assert time.monotonic() - started < 15 and not alive(int(slow.stdout.split()[0]))
