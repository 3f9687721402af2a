"""The pipeline_schedules suite: what it derives from the program's report."""

from __future__ import annotations

import pytest

from ddpguide.bench import SUITES
from ddpguide.bench import pipeline_schedules as suite
from ddpguide.bench.appendix import ANCHORS
from ddpguide.bench.report import Report
from ddpguide.pipeline import zoo


def test_ratios_come_from_the_timed_lines(monkeypatch):
    # Per schedule: one round, 2 ranks, (step, busy) seconds; bubble = (step - busy) / busy.
    lines = {s: [(0.2, 0.1)] * 2 for s in zoo.SCHEDULES}
    lines["Interleaved1F1B"] = [(0.1, 0.08)] * 2
    lines["InterleavedZeroBubble"] = [(0.11, 0.1)] * 2
    monkeypatch.setattr(suite, "measure_round", lambda plan: lines)
    report = Report("pipeline_schedules")
    suite.add_to(report, quick=True)
    assert report.ratios["interleaved_over_1f1b"] == pytest.approx(2.0)
    assert report.ratios["zb_bubble_over_1f1b_bubble"] == pytest.approx(0.1)
    counted = float(zoo.simulate("1F1B", 2, suite.plan(True)["microbatches"]).bubble)
    assert report.ratios["bubble_measured_over_formula_1F1B"] == pytest.approx(1.0 / counted)
    assert set(report.ratios) <= set(ANCHORS["pipeline_schedules"]) <= set(ANCHORS["pipeline"])
    assert "pipeline_schedules" in SUITES and suite.RANKS == 2


def test_a_failed_check_stops_the_suite(monkeypatch):
    class Run:
        report = {"checks": [{"name": "GPipe on 4 ranks x dp 1, m=8", "ok": False}],
                  "runs": [{"schedule": "GPipe", "microbatches": 8,
                            "ranks": [{"step_seconds": 1e-3, "busy_seconds": 5e-4}] * 4}]}

        @staticmethod
        def lines():
            return ["check: GPipe on 4 ranks x dp 1, m=8, matches one process within 1e-10: FAILED"]

    monkeypatch.setattr(suite, "run_program", lambda *a, **k: Run)
    with pytest.raises(RuntimeError, match="did not check out"):
        suite.measure_round(suite.plan(True))
