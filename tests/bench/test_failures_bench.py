"""The failures suite's quick mode: every ratio it reports, and its anchors."""

from __future__ import annotations

import pytest

from ddpguide.bench import appendix, failures


@pytest.mark.multiprocess
def test_quick_mode_reports_the_ratios_with_their_anchors():
    report = failures.run(quick=True)
    ratios = report.ratios
    assert ratios["diloco_bytes_over_ddp_times_h"] == 1.0
    assert 0.67 <= ratios["young_daly_best_interval_measured_over_predicted"] <= 1.5
    assert ratios["ft_recovery_s"] > 0
    assert ratios["ft_step_over_ddp_step"] > 0   # both step times measured in this run
    plain = next(m for m in report.measurements if m.name == "plain DDP step")
    assert plain.details["same_weights"] is True   # torchft's DDP and torch's: bitwise equal
    assert any(m.name == "torchft step" for m in report.measurements)
    assert "torchrun_recovery_s" not in ratios  # the full mode only
    assert set(ratios) <= set(appendix.ANCHORS["failures"])


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
