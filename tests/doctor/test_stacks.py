"""Finding a job's workers and reading their stacks: the parts that need no hung job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from ddpguide.doctor.stacks import dump_stack, find_workers, py_spy


def test_find_workers_by_marker_and_rank():
    marker = uuid.uuid4().hex
    env = {**os.environ, "DOCTOR_TEST_MARKER": marker, "RANK": "3"}
    child = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(30)"],
                             env=env, stdout=subprocess.PIPE, text=True)
    try:
        # Popen returns once the exec has begun, before the kernel has written the new
        # environment (/proc/PID/environ reads empty meanwhile): wait until the child runs
        assert child.stdout.readline() == "up\n"
        assert find_workers("DOCTOR_TEST_MARKER", marker) == {3: child.pid}
        assert find_workers("DOCTOR_TEST_MARKER", "other") == {}
    finally:
        child.kill()
        child.wait()


@pytest.mark.multiprocess
def test_dump_stack_of_a_missing_process_says_why():
    assert py_spy() is not None, "py-spy is in requirements.txt"
    attached, text = dump_stack(2 ** 22 + 12345)  # above the default pid_max: never a process
    assert not attached and text


def test_stacks_come_without_colour_even_when_colour_is_forced(monkeypatch):
    monkeypatch.setenv("CLICOLOR_FORCE", "1")  # what a notebook kernel sets
    child = subprocess.Popen([sys.executable, "-c", "import time\ndef waiting():\n    time.sleep(30)\nwaiting()"])
    try:
        deadline = time.monotonic() + 30
        while True:
            attached, text = dump_stack(child.pid)
            if "waiting (<string>:3)" in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert attached, text
        assert "\x1b[" not in text and "waiting (<string>:3)" in text
    finally:
        child.kill()
        child.wait()
