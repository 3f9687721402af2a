"""The failures suite's quick mode: every ratio it reports, and its anchors."""

from __future__ import annotations

import pytest

from ddpguide.bench import appendix, failures

pytestmark = pytest.mark.multiprocess


def test_quick_mode_reports_the_ratios_with_their_anchors():
    report = failures.run(quick=True)
    ratios = report.ratios
    assert ratios["diloco_bytes_over_ddp_times_h"] == 1.0
    assert 0.67 <= ratios["young_daly_best_interval_measured_over_predicted"] <= 1.5
    assert ratios["ft_recovery_s"] > 0
    assert "torchrun_recovery_s" not in ratios  # the full mode only
    assert set(ratios) <= set(appendix.ANCHORS["failures"])
