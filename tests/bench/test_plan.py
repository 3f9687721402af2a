"""The ``plan`` suite's quick mode on the emulated cluster (root): every ratio present, each fixed
one anchored in the appendix (``ddpguide.bench.plan_anchors``), memory within 5% of the count,
and every published row predicted."""

from __future__ import annotations

import pytest

from ddpguide.bench import plan
from ddpguide.bench.appendix import ANCHORS
from ddpguide.cluster import netns
from ddpguide.plan import perturb


@pytest.mark.multiprocess
@pytest.mark.skipif(netns.missing_prerequisite() is not None, reason=str(netns.missing_prerequisite()))
def test_quick_plan_suite():
    report = plan.run(quick=True)
    fixed = {"rank_correlation", "rank_correlation_dtensor_constants", "best_layout_measured_over_best_measured",
             "best_layout_measured_over_best_measured_dtensor_constants", "compute_share_min", "compute_share_max",
             "command_step_predicted_over_measured", "command_memory_predicted_over_measured",
             *(f"perturbed_{term}_out_of_band" for term in perturb.TERMS)}
    full_only = {"rank_correlation_loopback"}  # the loopback runs: not in the quick mode
    assert fixed <= set(report.ratios) and fixed | full_only == {k for k in ANCHORS["plan"] if not k.endswith(": *")}
    assert not full_only & set(report.ratios) and not any("loopback" in k for k in report.ratios)
    memory = {k: v for k, v in report.ratios.items() if k.startswith("memory_predicted_over_measured")}
    assert len(memory) == 2 and all(0.95 <= v <= 1.05 for v in memory.values()), memory
    steps = [k for k in report.ratios if k.startswith("step_predicted_over_measured")]
    assert sorted(steps) == sorted(f"step_predicted_over_measured: {name}" for name in plan.QUICK)
    assert all(report.ratios[k] > 0 for k in steps)
    assert sum(k.startswith("published_predicted_over_reported") for k in report.ratios) == 46


def test_per_layout_ratios_find_their_anchor():
    """A ratio named "kind: case" is anchored by the suite's "kind: *" (the appendix's goal)."""
    from ddpguide.bench.appendix import ratio_rows

    rows = ratio_rows({"suite": "plan", "ratios": {"step_predicted_over_measured: TP 4": 0.9,
                                                   "memory_predicted_over_measured: 8 ranks: FSDP 8": 1.0,
                                                   "step_predicted_over_measured_loopback: dim 32, CP 4": 1.1,
                                                   "published_predicted_over_reported: picotron, x": 1.2}})
    assert [anchor.goal for _, _, anchor in rows] == ["0.8-1.25", "0.95-1.05", "0.8-1.25", "median 0.8-1.25"]
