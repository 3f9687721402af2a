"""The DiLoCo invariants of ``failures.diloco`` on a made-up run where they hold, each fed a
report made to break it, where it must fail; and a DiLoCo run with a group killed from
outside, after which they hold."""

from __future__ import annotations

import pytest

from ddpguide.failures import diloco, runs
from ddpguide.launch import programs

PROGRAM = programs.load("ft_train.py")
H = 2


def row(event: str, group: int, t: float, incarnation: int = 0, **more: object) -> dict:
    return {"event": event, "group": group, "rank": 0, "incarnation": incarnation, "time": t,
            **more}


def good() -> dict:
    """Two groups, H = 2, three syncs: group 1 dies one inner step after sync 0, group 0
    commits sync 1 alone, group 1 comes back, heals in sync 2's quorum, both commit it."""
    rows = [row("started", 0, 0.0), row("started", 1, 0.0)]
    for g in (0, 1):
        rows += [row("inner", g, 1.0), row("inner", g, 2.0),
                 row("sync", g, 2.0, step=0, committed=True, participants=2, weights="a")]
    rows += [row("inner", 1, 3.0), row("inner", 0, 3.0), row("inner", 0, 4.0),
             row("sync", 0, 4.0, step=1, committed=True, participants=1, weights="b"),
             row("started", 1, 4.5, 1), row("inner", 1, 5.0, 1), row("inner", 0, 5.0),
             row("healed", 1, 5.5, 1, step=2), row("inner", 1, 6.0, 1), row("inner", 0, 6.0),
             row("sync", 0, 6.0, step=2, committed=True, participants=2, weights="c"),
             row("sync", 1, 6.0, 1, step=2, committed=True, participants=2, weights="c"),
             row("final", 0, 6.1, step=3), row("final", 1, 6.1, 1, step=3)]
    report = {"groups": 2, "steps": 3, "seed": 0, "hidden": 10, "left_running": []}
    for event in ("started", "inner", "sync", "healed", "final"):
        report[event] = [r for r in rows if r["event"] == event]
    return report


def failing(report: dict) -> set[str]:
    return {c["name"] for c in diloco.checks(report, PROGRAM, H) if not c["ok"]}


def test_every_invariant_holds_on_the_made_up_run_and_its_lost_steps_are_counted():
    assert failing(good()) == set()
    assert [(w["group"], w["incarnation"], w["inner_steps"], w["why"])
            for w in diloco.lost_windows(good())] == [(1, 0, 1, "died"), (1, 1, 2, "healed")]


def _sync(report: dict, group: int, step: int) -> dict:
    return next(r for r in report["sync"] if (r["group"], r["step"]) == (group, step))


def different_weights(r):
    _sync(r, 1, 2)["weights"] = "d"


def a_failed_sync_that_kept_its_inner_steps(r):
    r["sync"].append(row("sync", 0, 5.2, step=2, committed=False, participants=2, weights="x"))


def a_sync_nobody_committed(r):
    r["sync"].remove(_sync(r, 0, 1))


def a_sync_committed_twice(r):
    r["sync"].append(row("sync", 0, 6.05, step=2, committed=True, participants=1, weights="c"))


def more_than_h_steps_thrown_away(r):
    r["inner"] += [row("inner", 1, 3.5), row("inner", 1, 4.0)]


def a_restarted_group_that_synced_without_healing(r):
    r["healed"] = []


def a_process_left_running(r):
    r["left_running"] = [4321]


BROKEN = [(different_weights, "equal_after_sync"),
          (a_failed_sync_that_kept_its_inner_steps, "failed_sync_restores"),
          (a_sync_nobody_committed, "syncs_counted"), (a_sync_committed_twice, "syncs_counted"),
          (more_than_h_steps_thrown_away, "lost_at_most_h"),
          (a_restarted_group_that_synced_without_healing, "healed_before_its_first_sync"),
          (a_process_left_running, "nothing_left_running")]


@pytest.mark.parametrize("plant, check", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_each_invariant_fails_on_a_report_that_breaks_it(plant, check):
    report = good()
    plant(report)
    assert failing(report) == {check}


def test_a_failed_sync_that_put_the_last_syncs_weights_back_passes():
    report = good()
    report["sync"].append(row("sync", 0, 5.2, step=2, committed=False, participants=2, weights="b"))
    assert failing(report) == set()


@pytest.mark.multiprocess
def test_diloco_with_a_group_killed_from_outside(tmp_path):
    """Three groups of torchft's DiLoCo, H = 5, outer SGD with Nesterov momentum (lr 0.7,
    momentum 0.9), the lighthouse's min_replicas 2 (a restarted group never forms a quorum
    alone at step 0); one rank killed with SIGKILL. The killed group loses the inner steps
    since its last sync (at most H), its replacement's first H
    are replaced by the heal, and every invariant holds."""
    report = runs.run_ft(tmp_path / "run", failures=1, seed=2, kinds=("kill",), groups=3,
                         min_replicas=2, steps=2000, step_seconds=0.05, deadline_s=200.0,
                         extra=("--diloco", "5", "--nesterov", "--outer-momentum", "0.9",
                                "--outer-lr", "0.7"))
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    victim = report["failures"][0]["groups"][0]
    lost = diloco.lost_windows(report)
    died = [w for w in lost if w["why"] == "died"]
    assert all((w["group"], w["incarnation"]) == (victim, 0) and w["inner_steps"] <= 5
               for w in died), lost   # none at all when the kill fell just after a sync
    assert any(w["why"] == "healed" and (w["group"], w["incarnation"]) == (victim, 1)
               for w in lost), lost
