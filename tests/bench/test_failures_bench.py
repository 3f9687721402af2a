"""The failures suite's quick mode: every ratio it reports, and its anchors."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpguide.bench import appendix, failures


@pytest.mark.multiprocess
def test_quick_mode_reports_the_ratios_with_their_anchors():
    report = failures.run(quick=True)
    ratios = report.ratios
    assert ratios["diloco_bytes_over_ddp_times_h"] == 1.0
    assert 0.67 <= ratios["young_daly_best_interval_simulated_over_predicted"] <= 1.5
    assert 0.67 <= ratios["daly_best_interval_simulated_over_predicted"] <= 1.5
    assert ratios["ft_recovery_s"] > 0
    assert ratios["ft_step_over_ddp_step"] > 0   # both step times measured in this run
    plain = next(m for m in report.measurements if m.name == "plain DDP step")
    assert plain.details["same_weights"] is True   # torchft's DDP and torch's: bitwise equal
    assert any(m.name == "torchft step" for m in report.measurements)
    assert "torchrun_recovery_s" not in ratios  # the full mode only
    chaos = next(m for m in report.measurements if m.name == "chaos run")
    assert chaos.details["failures"] == ["SIGKILL (kill)"]   # the full mode adds hang, term
    assert chaos.details["failed_checks"] == []
    assert ratios["stall_measured_over_predicted_kill"] > 0
    assert ratios["rejoin_measured_over_predicted_kill"] > 0
    assert set(ratios) <= set(appendix.ANCHORS["failures"])


def test_a_saved_report_is_migrated_by_re_running_its_sweep(tmp_path):
    """The saved run of before the rename: the seeded sweep, re-run from its own C and restart,
    gives its figures again; with another C it does not, and the file is left as it was."""
    import json

    old = json.loads((Path(__file__).parents[2] / "book/measurements/failures.json").read_text())
    ratios = old["ratios"]
    ratios[failures.OLD_NAME] = ratios.pop("young_daly_best_interval_simulated_over_predicted")
    del ratios["daly_best_interval_simulated_over_predicted"]
    path = tmp_path / "failures.json"
    path.write_text(json.dumps(old))
    migrated = failures.migrate(path)
    now = json.loads(path.read_text())["ratios"]
    assert failures.OLD_NAME not in now
    assert now["young_daly_best_interval_simulated_over_predicted"] == ratios[failures.OLD_NAME]
    assert now["daly_best_interval_simulated_over_predicted"] == \
        migrated["daly_best_interval_simulated_over_predicted"]
    assert set(now) <= set(appendix.ANCHORS["failures"])
    next(m for m in old["measurements"] if m["name"] == "dcp sync_s")["value"] *= 4   # planted
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="does not give its saved figures"):
        failures.migrate(path)
    assert json.loads(path.read_text()) == old


def test_step_time_and_bytes_per_sync_read_from_a_report():
    """DDP: from the second committed step to the last; DiLoCo: from the first sync to the last,
    over the inner steps between (the rows a run of ft_train.py writes for group 0)."""
    ddp = {"inner": [], "step": [
        {"group": 0, "step": s, "committed": True, "time": t, "bytes": 100 * (s + 1),
         "calls": 2 * (s + 1)} for s, t in enumerate([0.0, 5.0, 5.5, 6.0, 6.5])]}
    assert failures.seconds_per_step(ddp) == 0.5
    assert failures.per_sync(ddp) == (100.0, 2.0)
    h = 4   # syncs after inner steps 3, 7, 11: manager step 1, 2, 3
    diloco = {"step": [], "inner": [
        {"group": 0, "inner": i, "step": (i + 1) // h, "time": 10.0 + 0.25 * i + (2.0 if i >= 3 else 0.0),
         "bytes": 80 * ((i + 1) // h), "calls": 4 * ((i + 1) // h)} for i in range(12)]}
    assert failures.seconds_per_step(diloco) == 0.25
    assert failures.per_sync(diloco) == (80.0, 4.0)


def _survivor_report(contributed: list[dict]) -> dict:
    """Group 1 commits every 0.2 s until 10.0, then at 11.5, 11.7, 11.9; group 0 is hit."""
    times = [8.0 + 0.2 * i for i in range(11)] + [11.5, 11.7, 11.9]
    return {"groups": 2, "step": [{"group": 1, "rank": 0, "committed": True, "time": t,
                                   "step": i} for i, t in enumerate(times)],
            "contributed": contributed, "healed": [{"group": 0, "time": 17.0},
                                                   {"group": 0, "time": 9.0}]}


def test_a_stall_is_predicted_from_the_timeouts_and_where_the_failure_landed():
    from ddpguide.failures import engine

    settings = engine.Settings(step_seconds=0.1, timeout_s=5, heartbeat_timeout_ms=1000,
                               join_timeout_ms=3000, quorum_tick_ms=100)
    report = _survivor_report([{"group": 1, "time": 10.3, "participants": 2}])
    kill = {"what": "SIGKILL (kill)", "groups": [0], "time": 10.05}
    # last commit 10.0, asks at 10.1; the victim's heartbeat is 1 s old at 11.05; half a tick
    assert failures.stall_predicted_s(report, kill, settings) == pytest.approx(0.95 + 0.05)
    shorter_join = engine.Settings(step_seconds=0.1, join_timeout_ms=500, quorum_tick_ms=100)
    assert failures.stall_predicted_s(report, kill, shorter_join) == pytest.approx(0.5 + 0.05)
    # stopped inside an all-reduce with every group: the collective's timeout, a step, a tick
    stop = {**kill, "what": "SIGSTOP", "time": 10.25}
    assert failures.stall_predicted_s(report, stop, settings) == pytest.approx(5 + 0.1 + 0.05)
    outside = _survivor_report([{"group": 1, "time": 10.3, "participants": 1}])
    assert failures.stall_predicted_s(outside, stop, settings) == pytest.approx(1.15 + 0.05)
    # a cut link silences the node as SIGSTOP does: the same two cases
    cut = {**stop, "what": "link down"}
    assert failures.stall_predicted_s(report, cut, settings) == pytest.approx(5 + 0.1 + 0.05)
    assert failures.stall_predicted_s(outside, cut, settings) == pytest.approx(1.15 + 0.05)
    # rejoin: from the signal to the group's first heal after it
    assert failures.rejoin_measured_s(report, kill) == pytest.approx(17.0 - 10.05)
    assert failures.rejoin_measured_s(report, {**kill, "time": 18.0}) is None
