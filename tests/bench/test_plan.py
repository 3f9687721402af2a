"""The ``plan`` suite's quick mode: every ratio present, each fixed one anchored in the appendix
(``ddpguide.bench.plan_anchors``), memory within 5% of the count."""

from __future__ import annotations

import pytest

from ddpguide.bench import plan
from ddpguide.bench.appendix import ANCHORS


@pytest.mark.multiprocess
def test_quick_plan_suite():
    report = plan.run(quick=True)
    fixed = {"rank_correlation", "rank_correlation_dtensor_constants", "best_layout_measured_over_best_measured",
             "best_layout_measured_over_best_measured_dtensor_constants"}
    assert fixed <= set(report.ratios) and fixed == set(ANCHORS["plan"])
    memory = {k: v for k, v in report.ratios.items() if k.startswith("memory_predicted_over_measured")}
    assert len(memory) == 2 and all(0.95 <= v <= 1.05 for v in memory.values()), memory
    steps = [k for k in report.ratios if k.startswith("step_predicted_over_measured")]
    assert len(steps) == 2 and all(report.ratios[k] > 0 for k in steps)
    assert sum(k.startswith("published_predicted_over_reported") for k in report.ratios) == 18
