"""ddpguide.elastic.program: elastic_train.py under two real agents, the second starting late."""

from __future__ import annotations

import re

import pytest

from ddpguide.elastic.program import check_join, run_join
from ddpguide.launch.torchrun import processes_of_launch


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_the_late_agent_joins_and_every_epoch_runs_once():
    run = run_join(epochs=24, epoch_seconds=0.4, timeout=200)
    facts = check_join(run)
    assert facts["world_sizes"] == [1, 2] and facts["checkpoint_epoch"] == 23
    assert 1 < facts["joined_before_epoch"] < 24  # B started after epoch 1 was logged
    commands = {r.agent.shell_command() for r in run.agents}
    assert len(commands) == 1  # both agents ran the reader's same command
    command = commands.pop()
    assert command.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 ")
    assert "--rdzv-endpoint=127.0.0.1:" in command and " elastic_train.py " in command
    assert processes_of_launch(run.agents[0].launch_id) == []


def test_check_join_fails_on_a_run_without_the_second_agent(tmp_path):
    from ddpguide.elastic.program import JoinRun

    class Done:  # an AgentRun stand-in: both exited 0, but the log shows one world size
        returncode = 0

        def lines(self):
            return []

    (tmp_path / "epochs.jsonl").write_text(
        "".join(f'{{"epoch": {e}, "world_size": 1, "restart_count": 0}}\n' for e in range(3)))
    with pytest.raises(AssertionError):
        check_join(JoinRun([Done(), Done()], tmp_path, 3))


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
def test_without_the_workaround_the_late_agent_fails_on_a_key_nobody_writes():
    from ddpguide.elastic.program import run_scale_up_hang, store_errors

    run = run_scale_up_hang(read_timeout=5, timeout=120)
    errors = store_errors(run)
    assert [r.returncode for r in run.agents] == [1, 1], errors
    key = f"/torch.rendezvous.{run.rdzv_id}.1/MASTER_ADDR"  # round 1: the round B joined
    assert errors["B"] == f"torch.distributed.DistStoreError: wait timeout after 5000ms, keys: {key}"
    assert f"/torch.rendezvous.{run.rdzv_id}.1/torchelastic/role_info/1" in errors["A"]
    assert {r["world_size"] for r in run.records()} == {1}  # nobody trained at world size 2
    command = run.agents[1].agent.shell_command()
    assert command.startswith("torchrun --nnodes=1:2 ") and re.search(r"\bread_timeout=5\b", command)
    assert re.search(r"\bread_timeout=10\b", run.agents[0].agent.shell_command())  # B gives up first: A hosts the store
    assert processes_of_launch(run.agents[0].launch_id) == []
