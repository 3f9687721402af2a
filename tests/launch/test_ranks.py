"""The one runner, ``ddpguide.launch.ranks``: what its result holds, its one first-failure
rule, its two wait modes, and a stop that ends even when a rank cannot be reaped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from ddpguide.launch import ranks

pytestmark = pytest.mark.multiprocess

SPEAKS = "import sys; print('out', flush=True); print('err', file=sys.stderr); sys.exit(2)"
ONLY_ERRORS = "import sys; print('usage: x', file=sys.stderr); sys.exit(2)"


def test_separate_errors_keep_each_stream_of_an_exec_d_rank():
    done = ranks.run([ranks.Command([sys.executable, "-c", SPEAKS])], 60, separate_errors=True)
    assert (done.returncodes, done.output, done.errors) == ([2], "out\n", "err\n")


def test_a_rank_that_writes_only_errors_has_them_in_the_result():
    done = ranks.run([ranks.Command([sys.executable, "-c", ONLY_ERRORS])], 60, separate_errors=True)
    assert (done.returncodes, done.output, done.errors) == ([2], "", "usage: x\n")


def test_without_separate_errors_both_streams_are_the_output():
    done = ranks.run([ranks.Command([sys.executable, "-c", SPEAKS])], 60)
    assert done.errors is None
    assert sorted(done.output.splitlines()) == ["err", "out"]


def shell(script: str) -> ranks.Command:
    return ranks.Command(["sh", "-c", script])


RECORDS_THEN_LINGERS = 'echo "$(date +%s.%N) {index}" >> "$DDPGUIDE_FAILURES_FILE"; sleep 1; exit 5'


def test_the_first_failure_is_the_earliest_recorded_not_the_first_seen(tmp_path):
    with ranks.Ranks(workdir=tmp_path) as group:
        group.start(shell("sleep 0.3; exit 3"))  # exits first, records nothing (killed, say)
        group.start(shell(RECORDS_THEN_LINGERS.format(index=1)))  # failed first, exits later
        assert group.wait(30, all_end=True) is ranks.Outcome.FAILED
        group.stop()
        end = group.ended()
    assert (end.returncodes, end.first_failure, end.returncode) == ([3, 5], 1, 5)


def test_without_records_the_first_failed_rank_seen_is_the_failure(tmp_path):
    with ranks.Ranks(workdir=tmp_path) as group:
        group.start(shell("sleep 1; exit 4"))
        group.start(shell("exit 3"))
        assert group.wait(30, all_end=True) is ranks.Outcome.FAILED
        group.stop()
        assert (group.ended().first_failure, group.ended().returncode) == (1, 3)


def test_first_failure_mode_stops_waiting_and_all_end_mode_waits_for_every_rank(tmp_path):
    for name in "abc":
        (tmp_path / name).mkdir()
    with ranks.Ranks(workdir=tmp_path / "a") as group:
        group.start(shell("exit 1"))
        group.start(shell("sleep 30"))
        started = time.monotonic()
        assert group.wait(60) is ranks.Outcome.FAILED  # failure_grace 0: at once
        assert time.monotonic() - started < 10 and group.returncodes() == [1, None]
        group.stop(grace=0.0)
        assert [r.returncode for r in group.ended().ranks] == [1, None]  # None: stopped
    with ranks.Ranks(workdir=tmp_path / "b") as group:
        group.start(shell("exit 1"))
        group.start(shell("sleep 0.5; echo late"))
        assert group.wait(60, all_end=True) is ranks.Outcome.FAILED
        assert group.returncodes() == [1, 0]
        assert group.wait(60, all_end=True, until=lambda: True) is ranks.Outcome.FAILED
    with ranks.Ranks(workdir=tmp_path / "c") as group:
        group.start(shell("exit 1"))
        group.start(shell("sleep 30"))
        assert group.wait(0.5, all_end=True) is ranks.Outcome.TIMEOUT


def test_each_rank_s_own_logs_are_in_its_end(tmp_path):
    with ranks.Ranks(workdir=tmp_path) as group:
        group.start(ranks.Command(["sh", "-c", "echo one; echo bad >&2"], name="a",
                                  log=tmp_path / "a.out", errors=tmp_path / "a.err"))
        group.start(ranks.Command(["sh", "-c", "echo two"], name="b", log=tmp_path / "b.out"))
        assert group.wait(30) is ranks.Outcome.DONE
        group.stop()
        end = group.ended()
    assert end.ranks == [ranks.RankEnd("a", 0, "one\n", "bad\n"), ranks.RankEnd("b", 0, "two\n", "")]


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_be_reaped_is_left_behind_in_bounded_time(tmp_path, monkeypatch):
    """A rank stuck in the kernel (D state) outlives SIGKILL: its wait would never return.
    The stop gives up after REAP_S, names it, and returns."""
    monkeypatch.setattr(ranks, "REAP_S", 1.0)
    with ranks.Ranks(workdir=tmp_path, separate_errors=True) as group:
        # sleep itself, not a shell around it: a shell that outlives its killed child prints
        # "Killed" into the rank's error log, before the runner's own line
        group.start(ranks.Command(["sleep", "60"]))
        process = group.processes[0]
        pid = process.pid

        def stuck_wait(timeout=None):
            if timeout is None:
                threading.Event().wait()  # the unbounded reap: never returns
            time.sleep(timeout)
            raise subprocess.TimeoutExpired(process.args, timeout)
        monkeypatch.setattr(process, "wait", stuck_wait)
        monkeypatch.setattr(process, "poll", lambda: None)  # never reaped: always running
        started = time.monotonic()
        group.stop(grace=0.0)
        took = time.monotonic() - started
        end = group.ended()
    try:
        assert took < 10, took
        assert end.unreaped == (0,)
        assert end.errors == (f"rank 0 (pid {pid}) was not reaped within 1 s of SIGKILL "
                              "(stuck in the kernel?): left behind\n")
    finally:
        os.waitpid(pid, 0)  # the real process was killed: reap it here
