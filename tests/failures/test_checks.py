"""Every invariant of ``failures.checks`` on a made-up report where it holds, and on one made
to break it, where it must fail."""

from __future__ import annotations

import copy

import pytest

from ddpguide.failures import checks
from ddpguide.launch import programs

PROGRAM = programs.load("ft_train.py")
BOUND_S = 5.0


def row(event: str, group: int, t: float, incarnation: int = 0, **more: object) -> dict:
    return {"event": event, "group": group, "rank": 0, "incarnation": incarnation, "time": t,
            **more}


def good() -> dict:
    """Two groups, three steps: group 1 dies after step 0, group 0 commits step 1 alone,
    group 1 is restarted, heals to step 2 from group 0 and both commit step 2."""
    rows = [row("started", 0, 0.0, pid=1), row("started", 1, 0.0, pid=2)]
    for g in (0, 1):
        rows += [row("contributed", g, 1.0, step=0, participants=2),
                 row("step", g, 1.1, step=0, participants=2, committed=True, weights="w1")]
    rows += [row("contributed", 0, 2.0, step=1, participants=1),
             row("step", 0, 2.1, step=1, participants=1, committed=True, weights="w2"),
             row("started", 1, 2.5, 1, pid=3), row("healed", 1, 2.9, 1, step=2, weights="w2")]
    for g, inc in ((0, 0), (1, 1)):
        rows += [row("contributed", g, 3.0, inc, step=2, participants=2),
                 row("step", g, 3.1, inc, step=2, participants=2, committed=True, weights="w3")]
    report = {"groups": 2, "group_size": 1, "steps": 3, "seed": 0, "lr": 0.1, "hidden": 10,
              "start": 0.0, "checkpoint": [], "left_running": [],
              "failures": [{"what": "SIGKILL (kill)", "groups": [1], "pids": [2], "time": 1.5}]}
    for event in ("started", "contributed", "step", "healed"):
        report[event] = [r for r in rows if r["event"] == event]
    params = [p.flatten().tolist() for p in checks.replay(report, PROGRAM)]
    report["final"] = [row("final", 0, 3.2, step=3, weights="w3", params=params),
                       row("final", 1, 3.2, 1, step=3, weights="w3", params=params)]
    return report


def failing(report: dict) -> set[str]:
    return {c["name"] for c in checks.checks(report, PROGRAM, BOUND_S) if not c["ok"]}


def test_every_invariant_holds_on_the_made_up_run():
    assert failing(good()) == set()
    assert checks.contributors(good()) == {0: [0, 1], 1: [0], 2: [0, 1]}


def _step(report: dict, group: int, step: int) -> dict:
    return next(r for r in report["step"] if (r["group"], r["step"]) == (group, step))


def one_group_did_not_commit(r):
    _step(r, 1, 2)["committed"] = False


def different_weights(r):
    _step(r, 1, 2)["weights"] = "other"


def healed_to_other_weights(r):
    r["healed"][0]["weights"] = "w1"


def healed_to_other_state(r):
    """With --state-mb 1: the heal's state digest is not the one the seed fills."""
    r["state_mb"] = 1
    r["healed"][0]["state"] = "0" * 16


def never_back(r):
    r["final"] = r["final"][:1]


def back_without_healing(r):
    r["healed"] = []


def survivor_stalls(r):
    for x in r["step"] + r["contributed"]:
        if x["group"] == 0 and x["step"] >= 1:
            x["time"] += 10.0
    for x in r["final"]:
        x["time"] += 10.0


def wrong_participants(r):
    _step(r, 0, 1)["participants"] = 2


def step_lost(r):
    r["step"] = [x for x in r["step"] if x["step"] != 1]


def step_applied_twice(r):
    r["step"].append(dict(_step(r, 0, 1), time=3.5))


def final_differs(r):
    r["final"][1]["params"][0][0] += 1e-12


def checkpoint_missing(r):
    r["checkpoint"] = [{"event": "checkpoint", "group": 0, "rank": 0, "step": 2,
                        "path": "/nonexistent/step-000002", "time": 3.2}]


def left_running(r):
    r["left_running"] = [12345]


BREAKS = [
    (one_group_did_not_commit, "committed_together"),
    (different_weights, "equal_after_commit"),
    (healed_to_other_weights, "heals_match_donor"),
    (healed_to_other_state, "heals_match_donor"),
    (never_back, "back_and_healed"),
    (back_without_healing, "back_and_healed"),
    (survivor_stalls, "survivors_keep_going"),
    (wrong_participants, "participants_match"),
    (step_lost, "steps_counted"),
    (step_applied_twice, "steps_counted"),
    (final_differs, "final_equals_replay"),
    (checkpoint_missing, "checkpoints_intact"),
    (left_running, "nothing_left_running"),
]


@pytest.mark.parametrize("breaks, name", BREAKS, ids=[b.__name__ for b, _ in BREAKS])
def test_each_invariant_fails_on_a_report_that_breaks_it(breaks, name):
    report = copy.deepcopy(good())
    breaks(report)
    assert name in failing(report)


def test_a_heal_that_carries_the_seeds_state_holds():
    report = good()
    report["state_mb"] = 1
    report["healed"][0]["state"] = PROGRAM.digest_of([PROGRAM.make_state(0, 1, 0)])
    assert failing(report) == set()
    assert PROGRAM.make_state(0, 1, 0).numel() * 8 == 2**20
    assert PROGRAM.make_state(0, 0, 0) is None


def test_ranks_of_one_group_that_disagree_are_a_split():
    report = good()
    report["step"].append(dict(_step(report, 0, 0), rank=1, committed=False))
    assert checks.committed_together(report) == [
        "step 0 with 2 participants: group 0 split: [(0, 0), (1, 0)] committed, [(0, 1)] did not"]


def test_a_group_that_did_not_commit_what_its_peers_did_heals_before_it_goes_on():
    """torchft votes inside each group: group 1, failing after its share of step 0's all-reduce
    reached group 0, does not commit step 0 while group 0 does; it is restarted and heals."""
    report = good()
    _step(report, 1, 0)["committed"] = False
    assert checks.committed_together(report) == []
    report["healed"][0]["time"] = 1.0  # the heal before the refusal: it went on from its own state
    assert checks.committed_together(report) == [
        "step 0 with 2 participants: [(0, 0)] committed, (1, 0) did not and went on without healing"]


def test_a_group_alone_that_tries_a_step_again_is_no_split():
    report = good()
    retry = dict(_step(report, 0, 1), committed=False, time=2.05)
    report["step"].insert(0, retry)
    assert checks.committed_together(report) == []
