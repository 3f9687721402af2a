"""``python -m ddpguide.bench elastic``: milestones found in the event stream, and the report.

(Named apart from tests/elastic/test_elastic.py: basenames are unique.) The
scenarios start torchrun agents for minutes; here they are replaced by made-up
recovery times, and the milestone search runs on made-up events.
"""

from __future__ import annotations

import pytest

from ddpguide.bench import elastic as elastic_bench

EVENTS = [
    {"event": "first_step", "t": 1.0, "rank": 0, "world_size": 4},
    {"event": "epoch", "t": 2.0, "rank": 1, "world_size": 4},  # not rank 0
    {"event": "epoch", "t": 3.0, "rank": 0, "world_size": 4},
    {"event": "first_step", "t": 5.0, "rank": 0, "world_size": 2},
    {"event": "agent_waiting", "t": 6.0},  # an agent's event has no rank
]


def test_milestones_are_rank_0_events_after_a_moment_at_a_world_size():
    first = elastic_bench._first
    assert first("first_step", 0.0)(EVENTS)["t"] == 1.0
    assert first("first_step", 1.0)(EVENTS)["t"] == 5.0  # strictly after
    assert first("first_step", 0.0, world_size=2)(EVENTS)["t"] == 5.0
    assert first("first_step", 5.0)(EVENTS) is None
    assert elastic_bench._epoch_done(0.0, 4)(EVENTS)["t"] == 3.0
    assert first("agent_waiting", 0.0)(EVENTS)["t"] == 6.0


class _Cluster:
    """Events arrive over time; ``poll`` reads them, as LocalCluster does."""

    nodes = ["A", "B"]

    def __init__(self, events):
        self.pending, self.all_events, self.polls = list(events), [], 0

    def poll(self):
        self.polls += 1
        if self.pending:
            self.all_events.append(self.pending.pop(0))

    def log_tail(self, name, lines):
        return f"last lines of {name}"


def test_waiting_returns_the_milestone_or_fails_with_the_nodes_logs():
    cluster = _Cluster(EVENTS)
    found = elastic_bench._wait(cluster, elastic_bench._first("first_step", 2.0), "a step", 30)
    assert found["t"] == 5.0 and cluster.polls == 4
    with pytest.raises(elastic_bench.ScenarioError) as info:
        elastic_bench._wait(_Cluster([]), elastic_bench._first("epoch", 0.0), "an epoch", 0.2)
    assert str(info.value) == ("no an epoch within 0.2 s\n--- A ---\nlast lines of A\n"
                               "--- B ---\nlast lines of B")


@pytest.mark.parametrize("quick, repeats, nproc", [(True, 1, 1), (False, 3, 2)])
def test_the_report_has_medians_per_setting_and_every_ratio(monkeypatch, quick, repeats, nproc):
    calls, workdirs, progresses = [], [], []
    real_tracked = elastic_bench.tracked

    def tracked(report, total, **kwargs):
        progress = real_tracked(report, total, **kwargs)
        progresses.append(progress)
        return progress

    monkeypatch.setattr(elastic_bench, "tracked", tracked)

    def scenario(workdir, torchrun_defaults, nproc, progress):
        assert workdir.is_dir()
        workdirs.append(workdir)
        calls.append((torchrun_defaults, nproc))
        slow = 10.0 if torchrun_defaults else 1.0
        run = sum(1 for c in calls if c[0] == torchrun_defaults)
        out = {"first_start": 3.0 * slow, "worker_crash": 4.0 * slow + run,
               "node_loss": 7.0 * slow, "join": 8.0 * slow}
        for case, seconds in out.items():  # as the real one reports each figure when measured
            progress.advance(case, [(case, seconds, "s")])
        return out

    monkeypatch.setattr(elastic_bench, "scenario", scenario)
    report = elastic_bench.run(quick=quick)
    (progress,) = progresses  # every figure of every scenario counted
    assert progress.total == progress.done == 8 * repeats
    assert calls == [(False, nproc)] * repeats + [(True, nproc)] * repeats
    assert not any(w.exists() for w in workdirs)  # every scenario's folder is removed
    median_run = (repeats + 1) // 2  # 1 of 1, 2 of 1..3
    assert report.ratios == {
        "join_s": 8.0, "torchrun_join_s": 80.0,
        "node_loss_s": 7.0, "torchrun_node_loss_s": 70.0,
        "worker_crash_s": 4.0 + median_run, "torchrun_worker_crash_s": 40.0 + median_run}
    assert report.get("torchrun first_start").value == 30.0
    assert report.get("ddpguide worker_crash").details["samples"] == [
        4.0 + r for r in range(1, repeats + 1)]
    assert any(f"nodes of {nproc} worker(s)" in note for note in report.notes)
