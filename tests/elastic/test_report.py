"""The run's timeline: recoveries are timed from the disturbance to the first step at the
expected world size; epochs come from the checkpoint's history."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ddpguide.core.checkpoint import save_checkpoint, training_state
from ddpguide.core.models import ToyModel
from ddpguide.elastic.demo import DemoSettings
from ddpguide.elastic.report import RunLog, build_report, summary


def _event(t: float, event: str, world_size: int, rank: int | None = 0, **fields) -> dict:
    return {"t": t, "event": event, "world_size": world_size, "rank": rank, "node": "A",
            "restart": 0, **fields}


def _history(world_sizes: list[int]) -> list[dict]:
    return [{"epoch": i, "world_size": w, "train_loss": 1.0 / (i + 1), "test_accuracy": None,
             "seconds": 1.0} for i, w in enumerate(world_sizes)]


def _scenario(echo=None) -> RunLog:
    log = RunLog(echo=echo)
    log.action("node A starts with 2 workers", 100.0, world_size=2)
    log.worker_event(_event(100.5, "spawned", 2, rank=1))  # not rank 0: no entry
    log.worker_event(_event(101.0, "start", 2, epoch=0, resumed=False))
    log.worker_event(_event(102.0, "first_step", 2, epoch=0))
    log.worker_event(_event(103.0, "epoch", 2, epoch=0, loss=1.0, seconds=1.0))
    log.action("node B joins", 104.0, expect=4, cause="join")
    log.worker_event(_event(104.5, "first_step", 2, epoch=1))  # the old size: not a recovery
    log.worker_event(_event(105.0, "start", 4, epoch=1, resumed=True))
    log.worker_event(_event(106.5, "first_step", 4, epoch=1))
    log.worker_event(_event(107.0, "epoch", 4, epoch=1, loss=0.5, seconds=0.5))
    log.action("node B leaves", 110.0, expect=2, cause="leave")
    log.worker_event(_event(111.0, "start", 2, epoch=2, resumed=True, restart=1))
    log.worker_event(_event(113.0, "first_step", 2, epoch=2))
    log.worker_event(_event(114.0, "epoch", 2, epoch=2, loss=0.33, seconds=1.0))
    log.action("a worker is killed", 120.0, expect=2, cause="crash")
    log.worker_event(_event(124.25, "first_step", 2, epoch=3))
    log.worker_event(_event(125.0, "epoch", 2, epoch=3, loss=0.25, seconds=1.0))
    log.worker_event(_event(126.0, "finished", 2))
    return log


def test_recoveries_are_timed_to_the_first_step_at_the_expected_size():
    lines: list[str] = []
    log = _scenario(lines.append)
    assert [(r["cause"], r["seconds"], r["world_size"], r["epoch"], r["time_s"])
            for r in log.recoveries] == [("join", 2.5, 4, 1, 6.5), ("leave", 3.0, 2, 2, 13.0),
                                         ("crash", 4.25, 2, 3, 24.25)]
    assert lines[0] == "   0.0 s  node A starts with 2 workers"
    assert "   6.5 s  first step at world size 4: recovered from the join in 2.5 s" in lines
    assert "   4.5 s  first step at world size 2" in lines  # printed, but no recovery


def test_report_and_summary_from_the_checkpoint_history(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    model = ToyModel()
    state = training_state(3, model, torch.optim.SGD(model.parameters(), lr=0.1),
                           history=_history([2, 4, 2, 2]))
    save_checkpoint(state, checkpoint)
    log = _scenario()
    # node A's first group failed to start: rank 0's MASTER_PORT was taken (torch's message)
    (tmp_path / "node-A.log").write_text(
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
        "address. port: 43719, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n")
    (tmp_path / "node-B.log").write_text("")
    cluster = SimpleNamespace(checkpoint=checkpoint, nodes={
        name: SimpleNamespace(log=tmp_path / f"node-{name}.log") for name in ("A", "B")})
    report = build_report(log, cluster, DemoSettings(epochs=4))
    assert report["failed_starts"] == {"A": 1, "B": 0}
    assert report["world_sizes"] == [2, 4, 2]  # groups that announced a start
    assert [(e["epoch"], e["world_size"], e["time_s"]) for e in report["epochs"]] == [
        (0, 2, 3.0), (1, 4, 7.0), (2, 2, 14.0), (3, 2, 25.0)]
    assert report["finished"] and report["duration_s"] == 26.0
    assert report["epochs_reported_twice"] == []
    assert summary(report).splitlines() == [
        "summary",
        "  worker groups: 3, world sizes 2 -> 4 -> 2",
        "  epochs finished: 4 of 4, each exactly once (3 at world size 2, 1 at world size 4)",
        "   join: 2.5 s to the first step at world size 4 (resumed at epoch 1)",
        "  leave: 3.0 s to the first step at world size 2 (resumed at epoch 2)",
        "  crash: 4.2 s to the first step at world size 2 (resumed at epoch 3)",
        "  failed starts (MASTER_PORT taken before rank 0 listened, one restart each): node A 1",
        "  finished: yes after 26 s",
    ]
    # An epoch reported twice, or fewer epochs than planned, is said so.
    log.worker_event(_event(127.0, "epoch", 2, epoch=3, loss=0.25, seconds=1.0))
    again = build_report(log, cluster, DemoSettings(epochs=5))
    assert again["epochs_reported_twice"] == [3] and not again["finished"]
    assert "4 of 5, NOT each exactly once" in summary(again)
