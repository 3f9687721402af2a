"""elastic_train.py: a second agent joins mid-run; every epoch runs once, world size 1 -> 2."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from ddpguide.core.processes import store_port as free_port
from tests.programs.programs_support import (
    PYTHON,
    TORCHRUN,
    copy_program,
    kill_launch,
    parse_error,
    run,
    start,
)

EPOCHS, EPOCH_SECONDS = 30, 0.4  # about 11 s for the second agent to join
# The tuned values of the chapter (FACTS: a restart in seconds instead of tens of seconds).
RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def agent_command(port: int) -> list[str]:
    """The chapter's command for one agent with one worker, on the loopback interface."""
    return [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
            f"--rdzv-conf={RDZV_CONF}", "--monitor-interval=0.5", "--max-restarts=3",
            "elastic_train.py", "--epochs", str(EPOCHS), "--epoch-seconds", str(EPOCH_SECONDS),
            "--epoch-log", "epochs.jsonl"]


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(condition, timeout: float, what: str, agents: dict[str, subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        failed = {name: p.returncode for name, p in agents.items() if p.poll() not in (None, 0)}
        assert not failed, f"agents failed while waiting for {what}: {failed}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


@pytest.mark.timeout(300)
def test_a_second_agent_joins_and_every_epoch_runs_exactly_once(tmp_path):
    folder = tmp_path / "reader"
    copy_program("elastic_train.py", folder)
    log = folder / "epochs.jsonl"
    command = agent_command(free_port())
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launch_id = uuid.uuid4().hex
    outputs = {name: open(tmp_path / f"agent-{name}.txt", "w") for name in ("a", "b")}
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = start(command, folder, launch_id, env, stdout=outputs["a"],
                            stderr=subprocess.STDOUT)
        wait_for(lambda: any(r["epoch"] >= 1 for r in read_log(log)), 120,
                 "epoch 1 from the first agent", agents)
        agents["b"] = start(command, folder, launch_id, env, stdout=outputs["b"],
                            stderr=subprocess.STDOUT)
        wait_for(lambda: all(p.poll() is not None for p in agents.values()), 180,
                 "end of both agents", agents)
    finally:
        kill_launch(launch_id)
        for f in outputs.values():
            f.close()
    texts = {name: (tmp_path / f"agent-{name}.txt").read_text() for name in agents}
    assert [p.returncode for p in agents.values()] == [0, 0], texts

    records = read_log(log)
    assert [r["epoch"] for r in records] == list(range(EPOCHS)), texts
    sizes = [r["world_size"] for r in records]
    assert sizes[0] == 1 and sizes[-1] == 2 and sizes == sorted(sizes), sizes
    # a node joining restarts the workers but is not a failure: the count stays 0
    assert {r["restart_count"] for r in records} == {0}
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == EPOCHS - 1
    assert "world size 2, restart count 0: resuming at epoch" in texts["a"] + texts["b"]


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "argument --epochs: expected a value > 0, got 0"),
    (["--epoch-log", "no/such/folder/log.jsonl"],
     "argument --epoch-log: cannot write a file at 'no/such/folder/log.jsonl'"),
    ([], "RANK is not set: start me with "
         "torchrun --standalone --nproc-per-node=2 elastic_train.py"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys,
                                                         args, message):
    path = copy_program("elastic_train.py", tmp_path)
    stderr = parse_error(path, args, monkeypatch, capsys)
    assert stderr == f"elastic_train.py: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic_train.py"]


def test_sigterm_waits_for_the_commit_and_then_stops_the_worker(tmp_path):
    path = copy_program("elastic_train.py", tmp_path)
    script = (
        "import importlib.util, os, signal, time\n"
        f"spec = importlib.util.spec_from_file_location('program', {str(path)!r})\n"
        "program = importlib.util.module_from_spec(spec); spec.loader.exec_module(program)\n"
        "with program.sigterm_held_back():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # as torchrun stops a worker\n"
        "    time.sleep(0.2)\n"
        "    print('commit finished', flush=True)\n"
        "print('went on after the commit', flush=True)\n"
    )
    result = run([PYTHON, "-c", script], tmp_path, timeout=60)
    assert (result.returncode, result.stdout) == (-signal.SIGTERM, "commit finished\n")


@pytest.mark.timeout(150)
def test_a_worker_exception_reaches_the_error_file_through_record(tmp_path):
    # a checkpoint that passes the start-up check but not load_state_dict: the worker raises
    path = copy_program("elastic_train.py", tmp_path)
    wrong = {"epoch": 0, "model": {"net1.weight": torch.zeros(3, 3)}, "optimizer": {}}
    torch.save(wrong, tmp_path / "wrong.pt")
    root_cause = tmp_path / "root_cause.json"
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=1", path.name,
                  "--checkpoint", "wrong.pt"], tmp_path, timeout=120,
                 env={"TORCHELASTIC_ERROR_FILE": str(root_cause)})
    assert result.returncode != 0
    # @record wrote the worker's exception; the agent copied it into its own error file
    message = json.loads(root_cause.read_text())["message"]
    assert message["message"].startswith("RuntimeError: Error(s) in loading state_dict for ToyModel")
    assert "elastic_train.py" in message["extraInfo"]["py_callstack"]
    assert "in main" in message["extraInfo"]["py_callstack"]
