import os
import re
import sys
import textwrap
import time

import psutil
import pytest

from ddpguide.launch.spawn import SpawnTimeout, WorkerError, _check_arguments, spawn
from tests.launch import spawn_workers


def _running_children() -> set[int]:
    running = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                running.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_returns_its_result(world_size, capsys):
    results = spawn(spawn_workers.report, world_size, timeout=60)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size and r["env_rank"] == r["rank"] for r in results)
    assert all(r["sum_of_ranks"] == sum(range(world_size)) for r in results)
    # each rank gets its share of the cores, not all of them
    assert all(r["threads"] == max(1, (os.cpu_count() or 1) // world_size) for r in results)
    assert len({r["pid"] for r in results}) == world_size
    # No rank is left running. (Asking whether the pid exists could find a new
    # process that was given the same number.)
    assert not _running_children() & {r["pid"] for r in results}


@pytest.mark.timeout(60)
def test_failing_rank_raises_with_its_own_traceback_and_stops_the_others():
    with pytest.raises(WorkerError) as info:
        spawn(spawn_workers.fail_on_rank, 2, 1, timeout=40, collective_timeout=30)
    returned = time.monotonic()
    assert info.value.rank == 1 and info.value.exitcode == 1
    assert "ValueError: rank 1 refuses to train" in str(info.value)
    assert "spawn_workers.py" in info.value.details  # the rank's own frame, not the launcher's
    # Timed from the failure, not from the start (start-up varies with the load):
    # the healthy rank waits in a barrier with a 30 s timeout and must be stopped.
    raised_at = float(re.search(r"raised at ([0-9.]+)", info.value.details).group(1))
    assert returned - raised_at < 15, "the healthy rank must be stopped, not left to time out"


@pytest.mark.timeout(60)
def test_hanging_ranks_are_stopped_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(SpawnTimeout, match=r"ranks \[0, 1\] did not finish within 3 s"):
        spawn(spawn_workers.sleep_forever, 2, timeout=3)
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_mismatched_collective_fails_within_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(spawn_workers.skip_a_collective, 2, timeout=45, collective_timeout=3)
    assert info.value.rank == 0
    assert "Timed out" in info.value.details or "timeout" in info.value.details.lower()
    assert time.monotonic() - start < 25


@pytest.mark.timeout(60)
def test_worker_the_children_cannot_import_reports_the_real_error(tmp_path, monkeypatch):
    # Like a function defined in a notebook: the parent can call it, the children
    # cannot find it. The child's own error text must reach the caller.
    (tmp_path / "parent_only.py").write_text(textwrap.dedent("""
        def work():
            return 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import parent_only

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(WorkerError) as info:
        spawn(parent_only.work, 2, timeout=40)
    assert "No module named 'parent_only'" in info.value.details


BAD_ARGUMENTS = [
    # (args, kwargs, the exact ValueError message)
    (("not a function", 2), {}, "fn must be callable, got 'not a function'"),
    ((lambda: 1, 2), {}, "fn must be defined at the top level of a module, so that the ranks "
                         "can import it; got tests.launch.test_spawn.<lambda>"),
    ((spawn_workers.report, 0), {}, "world_size must be a positive integer, got 0"),
    ((spawn_workers.report, 2), {"kwargs": [("a", 1)]},
     "kwargs must map argument names to values, got [('a', 1)]"),
    ((spawn_workers.report, True), {}, "world_size must be a positive integer, got True"),
    ((spawn_workers.report, 2.0), {}, "world_size must be a positive integer, got 2.0"),
    ((spawn_workers.report, 2), {"timeout": 0},
     "timeout must be a finite number of seconds > 0, got 0"),
    ((spawn_workers.report, 2), {"timeout": float("nan")},
     "timeout must be a finite number of seconds > 0, got nan"),
    ((spawn_workers.report, 2), {"timeout": "60"},
     "timeout must be a finite number of seconds > 0, got '60'"),
    ((spawn_workers.report, 2), {"collective_timeout": float("inf")},
     "collective_timeout must be a finite number of seconds > 0, got inf"),
    ((spawn_workers.report, 2), {"collective_timeout": 1e9},
     "collective_timeout must be at most 604800 seconds (a week), got 1000000000.0"),
    ((spawn_workers.report, 2), {"threads_per_rank": 0},
     "threads_per_rank must be a positive integer or None, got 0"),
    ((spawn_workers.report, 2), {"threads_per_rank": 1.5},
     "threads_per_rank must be a positive integer or None, got 1.5"),
    ((spawn_workers.report, 2), {"env": "A=1"},
     "env must map variable names to strings, got 'A=1'"),
    ((spawn_workers.report, 2), {"env": {"A": 1}},
     "env must map variable names to strings, got A=1"),
    ((spawn_workers.report, 2), {"env": {"A=B": "1"}}, "env has an invalid variable name 'A=B'"),
    ((spawn_workers.report, 2), {"env": {"": "1"}}, "env has an invalid variable name ''"),
    ((spawn_workers.report, 2), {"backend": "mpi"}, "unknown backend 'mpi': choose one of gloo, nccl"),
    ((spawn_workers.report, 2), {"device_type": "tpu"},
     "unknown device 'tpu': choose one of cpu, cuda"),
]


@pytest.mark.timeout(30)
def test_bad_arguments_are_clear_value_errors_before_anything_starts(tmp_path, monkeypatch):
    """Each bad argument: its own message, no process, no store, no temporary folder."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR: spawn's folder lands here
    started = []
    monkeypatch.setattr("ddpguide.launch.spawn.dist.TCPStore",
                        lambda *a, **k: started.append("store") or (_ for _ in ()).throw(
                            AssertionError("a store started despite a bad argument")))
    children_before = _running_children()
    for args, kwargs, message in BAD_ARGUMENTS:
        with pytest.raises(ValueError) as info:
            spawn(*args, **kwargs)
        assert str(info.value) == message, (args, kwargs)
    assert started == [] and list(tmp_path.iterdir()) == []
    assert _running_children() <= children_before
    # and the good ones pass the same checks
    _check_arguments(spawn_workers.report, 1, {"timeout": 604800, "collective_timeout": 0.5}, 3,
                     {"A": ""})


@pytest.mark.timeout(120)
def test_the_runtime_spawn_chooses_is_the_one_its_workers_choose():
    # With two GPUs visible, a worker asking select_runtime() on its own would pick
    # nccl on cuda; spawn(..., backend="gloo") made a gloo group, so the worker must
    # be told CPU.
    results = spawn(spawn_workers.runtime_with_two_fake_gpus, 2, backend="gloo", timeout=90)
    assert results == [("gloo", "cpu"), ("gloo", "cpu")]


@pytest.mark.timeout(120)
def test_a_worker_that_exits_0_without_a_result_is_named():
    with pytest.raises(WorkerError) as info:
        spawn(spawn_workers.leave_without_returning, 2, timeout=90, echo=False)
    assert info.value.exitcode == 0
    assert "exited with code 0 but returned no result" in str(info.value)


@pytest.mark.multiprocess
def test_the_function_s_keywords_never_mix_with_spawn_s_own():
    """``timeout`` and ``echo`` in ``kwargs`` are the function's, not the launch's."""
    assert spawn(spawn_workers.keywords, 1, kwargs={"timeout": 0, "echo": "x"}, echo=False) == [
        {"timeout": 0, "echo": "x"}]
