"""Chaos from outside: the step each failure landed in, and short runs of every kind of
failure, after which every invariant holds."""

from __future__ import annotations

import pytest

from ddpguide.failures import chaos, runs


def test_a_failure_lands_in_the_last_step_begun_before_it():
    rows = [{"event": "contributed", "step": s, "time": float(s)} for s in range(5)]
    failures = [{"what": "SIGKILL (kill)", "time": 2.5}, {"what": "x", "time": -1.0}]
    assert [f["step"] for f in chaos.landed(failures, rows)] == [2, 0]


@pytest.mark.multiprocess
def test_a_short_chaos_run_of_kills_segfaults_hangs_and_a_lighthouse_restart(tmp_path):
    """The run ends 10 steps after its last failure's group is back (at most 1200 steps)."""
    report = runs.run_ft(tmp_path / "run", failures=3, seed=3, in_order=True,
                         kinds=("segv", "hang", "lighthouse"), groups=2, steps=1200,
                         step_seconds=0.1, gap_s=(0.5, 1.0), deadline_s=150.0)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    assert [f["what"] for f in report["failures"]][:2] == ["SIGSEGV (segv)", "SIGSTOP"]
    assert report["failures"][-1]["what"] == "lighthouse killed", report["failures"]


@pytest.mark.multiprocess
def test_a_donor_killed_while_it_serves_a_heal(tmp_path):
    """A group killed; while its replacement fetches the checkpoint (128 MB more state, so that
    the transfer lasts), the rank serving it is killed too. The two restarted groups, both at
    step 0, may form a quorum of their own before the third, stuck in its failed step, asks for
    one; neither trains in it (ft_train.py's wait_for_a_peer: each heals first to the step its
    earlier incarnation saw), and both heal from the third."""
    report = runs.run_ft(tmp_path / "run", failures=1, seed=4, kinds=("donor",), groups=3,
                         steps=1200, step_seconds=0.1, state_mb=128, deadline_s=200.0)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    first, served = report["failures"]
    assert (first["what"], served["what"]) == ("SIGKILL (donor)", "SIGKILL (donor serving a heal)")
    assert served["healing"] == first["groups"] and served["groups"] != first["groups"]
    hit = first["groups"] + served["groups"]
    back = {g: [h["step"] for h in report["healed"] if h["group"] == g and h["incarnation"] == 1]
            for g in hit}
    assert all(steps and steps[0] > 0 for steps in back.values()), back   # healed, from a peer


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("seed, group_size", [(0, 1), (1, 2)])
def test_a_long_chaos_run_of_every_kind(tmp_path, seed, group_size):
    """A failure ends at most two incarnations of a group (``heal``: the rank, then its
    replacement), and all 8 may hit the same group: torchrun may restart a group 16 times.
    The run ends 10 steps after its last failure's group is back (at most 2500 steps), within
    pytest's 300 s."""
    report = runs.run_ft(tmp_path / "run", failures=8, seed=seed, kinds=chaos.KINDS, groups=3,
                         group_size=group_size, steps=2500, step_seconds=0.1, deadline_s=280.0,
                         max_restarts=16)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    assert len(report["failures"]) >= 6, report["failures"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, groups", [("heal", 2), ("quorum", 2), ("two", 3)])
def test_a_rank_killed_while_its_group_heals_or_a_quorum_forms_or_two_groups_at_once(
        tmp_path, kind, groups):
    """heal: the replacement is killed as soon as its Manager is up (its "started" row), while
    it joins its first quorum and heals; quorum: just after a step row, while the next quorum
    forms; two: a rank of each of two of three groups at once."""
    report = runs.run_ft(tmp_path / "run", failures=1, seed=4, kinds=(kind,), groups=groups,
                         steps=150, step_seconds=0.1, deadline_s=240.0)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    whats = [f["what"] for f in report["failures"]]
    victims = report["failures"][0]["groups"]
    incarnations = {g: max(r["incarnation"] for r in report["started"] if r["group"] == g)
                    for g in victims}
    if kind == "heal":   # the replacement killed too: the group came back a second time
        assert whats == ["SIGKILL (heal)", "SIGKILL (while healing)"], whats
        assert list(incarnations.values()) == [2]
    else:
        assert whats == [f"SIGKILL ({kind})"], whats
        assert list(incarnations.values()) == [1] * (2 if kind == "two" else 1)
