"""Ranks forked from the warm server: the caller's environment and log at the start, a
fresh interpreter where only one can take a setting, and no server outliving its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ddpguide.launch import warm
from ddpguide.launch.spawn import spawn
from tests.launch import spawn_workers


def test_exec_time_variables_are_those_a_fresh_interpreter_reads():
    environ = {"MALLOC_MMAP_THRESHOLD_": "1", "OMP_NUM_THREADS": "1", "OMP_PROC_BIND": "true",
               "PYTHONHASHSEED": "0", "RANK": "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
               "TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "DDPGUIDE_X": "1", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "r", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # read later
               "TORCH_FR_BUFFER_SIZE": "2", "TORCH_FR_DUMP_TEMP_FILE": "/tmp/fr/rank_"}
    assert warm.exec_time_variables(environ) == {
        "MALLOC_MMAP_THRESHOLD_": "1", "OMP_PROC_BIND": "true", "PYTHONHASHSEED": "0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}


def test_the_start_method_is_spawn_when_asked_or_when_the_call_changes_a_setting(monkeypatch):
    monkeypatch.delenv(warm.START_METHOD_ENV, raising=False)
    assert warm.start_method({**os.environ, "RANK": "1", "OMP_NUM_THREADS": "2"}) == "forkserver"
    assert warm.start_method({**os.environ, "MALLOC_TRIM_THRESHOLD_": "1"}) == "spawn"
    monkeypatch.setenv(warm.START_METHOD_ENV, "spawn")
    assert warm.start_method(dict(os.environ)) == "spawn"


def test_a_warm_start_replaces_the_environment_and_sends_output_to_the_log(tmp_path):
    log = tmp_path / "rank0.log"
    code = textwrap.dedent(f"""
        import os, sys
        from ddpguide.launch.warm import WarmStart
        os.environ["LEFT_OVER"] = "1"
        WarmStart({{"ONLY": "this"}}, {str(log)!r}).apply()
        print(sorted(os.environ), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""
    assert log.read_text() == "['ONLY']\nto stderr\n"


@pytest.mark.multiprocess
def test_ranks_fork_from_the_server_and_see_the_environment_of_the_call(monkeypatch):
    monkeypatch.delenv(warm.START_METHOD_ENV, raising=False)
    monkeypatch.setenv("DDPGUIDE_TEST_SEEN", "set after the server may have started")
    ranks = spawn(spawn_workers.parent_and_variables, 2, ("DDPGUIDE_TEST_SEEN", "DDPGUIDE_TEST_ARG"),
                  env={"DDPGUIDE_TEST_ARG": "from env="}, echo=False)
    server = warm.server_pid()
    assert server is not None
    for rank, seen in enumerate(ranks):
        assert seen["parent"] == server
        assert seen["variables"] == {"DDPGUIDE_TEST_SEEN": "set after the server may have started",
                                     "DDPGUIDE_TEST_ARG": "from env="}
        assert seen["rank"] == str(rank)


@pytest.mark.multiprocess
def test_settings_only_a_fresh_interpreter_reads_get_a_fresh_interpreter_and_reach_the_rank(monkeypatch):
    """The C library's allocator reads MALLOC_*, ``import torch.distributed`` reads
    TORCH_DISTRIBUTED_DEBUG: such ranks are spawned (which variable decides it:
    ``test_the_start_method_is_spawn_when_asked_or_when_the_call_changes_a_setting``)."""
    monkeypatch.delenv(warm.START_METHOD_ENV, raising=False)
    ranks = spawn(spawn_workers.parent_and_variables, 2, ("MALLOC_ARENA_MAX",),
                  env={"MALLOC_ARENA_MAX": "2", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, echo=False)
    assert [seen["parent"] for seen in ranks] == [os.getpid()] * 2
    assert all(seen["variables"] == {"MALLOC_ARENA_MAX": "2"} for seen in ranks)
    assert [seen["debug_level"] for seen in ranks] == ["DETAIL", "DETAIL"]


@pytest.mark.multiprocess
def test_the_server_and_its_ranks_die_with_their_parent(tmp_path):
    """A parent killed while its ranks run takes the server and the ranks with it."""
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from ddpguide.launch.spawn import spawn
        from tests.launch import spawn_workers
        if __name__ == "__main__":
            spawn(spawn_workers.touch_and_sleep, 2, {str(ready)!r}, echo=False, timeout=120)
    """)
    script = tmp_path / "parent.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != warm.START_METHOD_ENV}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("ready*"))) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        below = psutil.Process(parent.pid).children(recursive=True)
        servers = [p for p in psutil.Process(parent.pid).children() if "forkserver" in " ".join(p.cmdline())]
        assert len(servers) == 1
        ranks = servers[0].children()
        assert len(ranks) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        gone, alive = psutil.wait_procs(below, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


@pytest.mark.multiprocess
@pytest.mark.parametrize("env", [{}, {"MALLOC_ARENA_MAX": "2"}], ids=["forked", "spawned"])
def test_the_server_and_the_resource_tracker_lead_sessions_of_their_own(tmp_path, env):
    """Outside the caller's process group, where a Jupyter kernel's shutdown would wait for
    them (the module's docstring). In a fresh interpreter: in this one the tracker may have
    started before, by another test."""
    code = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from multiprocessing import resource_tracker
        from ddpguide.launch import warm
        from ddpguide.launch.spawn import spawn
        from tests.launch import spawn_workers
        if __name__ == "__main__":
            ranks = spawn(spawn_workers.parent_and_variables, 2, (), env={env!r}, echo=False)
            helpers = [resource_tracker._resource_tracker._pid, warm.server_pid()]
            print(json.dumps({{"me": os.getsid(0), "pid": os.getpid(), "parents": [r["parent"] for r in ranks],
                              "helpers": [(p, os.getsid(p)) for p in helpers if p is not None]}}))
    """)
    (tmp_path / "parent.py").write_text(code)
    done = subprocess.run([sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != warm.START_METHOD_ENV})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert len(seen["helpers"]) == (1 if env else 2)  # spawned ranks start no server
    assert all(sid == pid != seen["me"] for pid, sid in seen["helpers"]), seen
    assert seen["parents"] == [seen["pid"] if env else seen["helpers"][1][0]] * 2  # spawned, or forked


@pytest.mark.multiprocess
def test_a_setting_this_process_changes_starts_the_server_again(monkeypatch):
    """A notebook cell (or a library) that sets such a variable gets a server that read it."""
    monkeypatch.delenv(warm.START_METHOD_ENV, raising=False)
    before = spawn(spawn_workers.parent_and_variables, 2, (), echo=False)[0]["parent"]
    assert before == warm.server_pid()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    ranks = spawn(spawn_workers.parent_and_variables, 2, (), echo=False)
    assert [seen["debug_level"] for seen in ranks] == ["DETAIL", "DETAIL"]
    after = warm.server_pid()
    assert after not in (None, before)
    assert [seen["parent"] for seen in ranks] == [after] * 2
