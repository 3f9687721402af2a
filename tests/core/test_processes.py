"""Ports, process trees and exits, written once for the whole package."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpguide.core.processes import descendants, ephemeral_port, signal_all, store_port


def test_an_ephemeral_port_can_be_bound_again():
    port = ephemeral_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_store_port_is_free_and_below_the_ephemeral_range():
    first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = store_port()
    assert 20000 <= port < first
    with socket.socket() as sock:
        sock.bind(("", port))


def test_descendants_finds_grandchildren_and_signal_all_kills_them():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "time.sleep(60)"])
    try:
        deadline = time.monotonic() + 20
        while len(descendants(parent.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [parent.pid, *descendants(parent.pid)]
        assert len(tree) == 2
        signal_all(tree, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and "Z" not in
                  Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for pid in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal_all([parent.pid], signal.SIGKILL)
        parent.wait(10)
    assert parent.returncode == -signal.SIGKILL
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in
                   Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                   for pid in tree[1:])


def test_exit_now_flushes_and_skips_teardown():
    code = ("import atexit, sys\n"
            "from ddpguide.core.processes import exit_now\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            "sys.stdout.write('written before exit')\n"
            "exit_now(7)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (7, "written before exit")
