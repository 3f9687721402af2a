"""A restarted group that finds no live peer refuses to train from step 0, and a checkpoint
that exists is never replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ddpguide.core.processes import store_port
from ddpguide.failures import engine
from ddpguide.launch import programs


def test_a_restarted_group_with_no_live_peer_refuses_to_train_alone(tmp_path):
    program = programs.load(engine.PROGRAM)
    port = store_port()
    lighthouse = subprocess.Popen(engine.lighthouse_argv(engine.Settings(), port),
                                  env={**os.environ, "RUST_LOG": "error"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not program.lighthouse_reachable(url, 0.2):
            assert time.monotonic() < deadline and lighthouse.poll() is None
            time.sleep(0.05)
        env = {**os.environ, "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2",
               "TORCHFT_LIGHTHOUSE": url, "TORCHELASTIC_RESTART_COUNT": "1",  # planted restart
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        ended = subprocess.run([sys.executable, str(programs.path_of(engine.PROGRAM)),
                                "--rows", str(tmp_path / "rows"), "--linger", "2",
                                "--step-seconds", "0.05", "--timeout", "5"],
                               env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        lighthouse.kill()
        lighthouse.wait(10)
    assert ended.returncode == 1, ended.stderr
    assert ended.stderr.splitlines()[-1] == (
        "ft_train: group 1, restarted (incarnation 1), found no live peer to heal from in 2 s: "
        "it will not train from step 0 alone"), ended.stderr
    rows = [json.loads(line) for line in (tmp_path / "rows" / "group1.rank0.jsonl").open()]
    assert [r["event"] for r in rows] == ["started"]


class _Manager:   # what save_checkpoint asks of torchft's Manager, for a checkpoint of step 10
    def current_step(self):
        return 10

    def state_dict(self):
        return {"step": 10, "batches_committed": 20}


def test_a_checkpoint_that_exists_is_never_replaced(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    program = programs.load(engine.PROGRAM)
    complete = tmp_path / "group0" / "step-000010"
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"the first incarnation's")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    model = program.make_model(3)
    args = SimpleNamespace(checkpoint=str(tmp_path), group=0, rank=0)
    path = program.save_checkpoint(args, model, _Manager())
    assert path == str(complete) + ".2"
    assert [p.name for p in complete.iterdir()] == [".metadata"]
    assert (complete / ".metadata").read_bytes() == b"the first incarnation's"
    assert sorted(p.name for p in (tmp_path / "group0").iterdir()) == ["step-000010",
                                                                        "step-000010.2"]
    state = {"model": program.make_model(4).state_dict(),
             "torchft": {"step": 0, "batches_committed": 0}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state["torchft"]["step"] == 10
    assert all(torch.equal(a, b) for a, b in zip(state["model"].values(),
                                                  model.state_dict().values()))
