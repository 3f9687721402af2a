"""ddpguide.elastic.program: elastic_train.py under two real agents, the second starting late."""

from __future__ import annotations

import json
import re

import pytest

from ddpguide.elastic.program import JoinFailed, check_join, run_join
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


class Done:  # an AgentRun stand-in: its exit status and what it printed
    def __init__(self, returncode=0, said=()):
        self.returncode, self.said = returncode, list(said)

    def lines(self):
        return self.said


RESUMED = "world size 2, restart count 0: resuming at epoch 2"
#: a made-up join that holds: epochs 0-1 at world size 1, 2-3 at 2, the checkpoint of epoch 3
SIZES, RESTARTS, SAVED = [1, 1, 2, 2], [0, 0, 0, 0], 3


def made_up_join(tmp_path, epochs=range(4), sizes=SIZES, restarts=RESTARTS, saved=SAVED,
                 codes=(0, 0), said=RESUMED):
    import torch

    from ddpguide.elastic.program import JoinRun

    (tmp_path / "epochs.jsonl").write_text("".join(
        json.dumps({"epoch": e, "world_size": n, "restart_count": r}) + "\n"
        for e, n, r in zip(epochs, sizes, restarts)))
    torch.save({"epoch": saved}, tmp_path / "checkpoint.pt")
    return JoinRun([Done(codes[0], [said]), Done(codes[1])], tmp_path, 4)


def test_check_join_passes_a_made_up_join_that_holds(tmp_path):
    assert check_join(made_up_join(tmp_path)) == {
        "epochs": 4, "world_sizes": [1, 2], "joined_before_epoch": 2, "checkpoint_epoch": 3}


@pytest.mark.parametrize("changes, claim", [
    ({"codes": (0, 1)}, "both agents exit 0"),
    ({"epochs": [0, 1, 1, 3]}, "epochs 0..3 once each, in order"),
    ({"sizes": [1, 1, 1, 1]}, "the world size grows from 1 to 2"),  # B never joined
    ({"sizes": [1, 2, 1, 2]}, "the world size grows from 1 to 2"),
    ({"restarts": [0, 0, 1, 1]}, "the restart count stays 0"),
    ({"saved": 2}, "the checkpoint holds epoch 3"),
    ({"said": "world size 2, restart count 0: starting at epoch 0"},
     f"rank 0 printed {RESUMED!r}"),
], ids=["an-agent-failed", "an-epoch-twice", "one-world-size", "shrank", "restarted", "old-checkpoint",
        "started-afresh"])
def test_check_join_fails_on_a_made_up_join_that_breaks_one_claim(tmp_path, changes, claim):
    with pytest.raises(JoinFailed) as failed:
        check_join(made_up_join(tmp_path, **changes))
    assert str(failed.value).startswith(f"{claim}: ")


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
