"""The pipeline_schedules suite: what it derives from the program's report."""

from __future__ import annotations

import pytest

from ddpguide.bench import SUITES
from ddpguide.bench import pipeline_schedules as suite
from ddpguide.bench.appendix import ANCHORS
from ddpguide.bench.report import Report
from ddpguide.launch.programs import ProgramRun
from ddpguide.launch.report import ReportError
from ddpguide.pipeline import zoo


def timed(bubbles, seconds=0.2, others=0.0):
    """The program's timed summary: one step per bubble, other processes ``others`` s on each rank's core."""
    return {"steps": [{"seconds": seconds, "bubble": b, "others_on_core": [others, None]} for b in bubbles],
            "costs": {"F0": 0.010, "F1": 0.010, "I1": 0.011, "W1": 0.012, "I0": 0.0, "W0": 0.023}}


def test_ratios_come_from_the_quiet_timed_steps(monkeypatch):
    m = suite.plan(True)["microbatches"]
    one_f_one_b = float(zoo.bubble_formula("1F1B", 2, m))
    steps = {s: timed([0.3, 0.3, 0.3]) for s in zoo.SCHEDULES}
    # 1F1B: two quiet steps at 1.1 x the formula, one in which others took 10 % of a rank's core
    steps["1F1B"] = {"steps": timed([1.1 * one_f_one_b] * 2)["steps"] + timed([5.0], others=0.02)["steps"],
                     "costs": steps["1F1B"]["costs"]}
    steps["Interleaved1F1B"] = timed([0.2] * 3, seconds=0.1)
    steps["InterleavedZeroBubble"] = timed([0.11 * one_f_one_b] * 3)
    monkeypatch.setattr(suite, "measure_round", lambda plan: steps)
    report = Report("pipeline_schedules")
    suite.add_to(report, quick=True)
    assert report.ratios["bubble_measured_over_formula_1F1B"] == pytest.approx(1.1)  # the loud step left out
    assert report.ratios["zb_bubble_over_1f1b_bubble"] == pytest.approx(0.1)
    assert report.ratios["interleaved_over_1f1b"] == pytest.approx(2.0)
    assert report.ratios["quiet_step_share"] == pytest.approx(20 / 21)
    details = report.get("InterleavedZeroBubble: idle / busy time, measured").details
    assert details["measured_costs"] == "F 10, I 11, W 12, B 23"  # stage 0's I and W left out
    assert set(report.ratios) <= set(ANCHORS["pipeline_schedules"]) <= set(ANCHORS["pipeline"])
    assert "pipeline_schedules" in SUITES and suite.RANKS == 2


def test_with_no_quiet_step_every_step_counts_and_the_notes_say_so(monkeypatch):
    monkeypatch.setattr(suite, "measure_round", lambda plan: {s: timed([0.5, 0.7, 0.9], others=0.1)
                                                               for s in zoo.SCHEDULES})
    report = Report("pipeline_schedules")
    suite.add_to(report, quick=True)
    assert report.get("GPipe: idle / busy time, measured").value == pytest.approx(0.7)
    assert report.ratios["quiet_step_share"] == 0
    assert "none did, so every figure here is the machine's" in report.notes[0]


def test_a_failed_check_stops_the_suite(monkeypatch, tmp_path):
    report = {"checks": [{"name": "GPipe on 2 ranks x dp 1, m=4", "ok": False}],
              "runs": [{"schedule": "GPipe", "microbatches": 4, "timed": timed([0.3] * 3)}]}
    said = "check: GPipe on 2 ranks x dp 1, m=4, matches one process within 1e-10: FAILED\n"
    run = ProgramRun("torchrun pipeline_schedules.py", 1, said, 1.0, tmp_path, report)
    monkeypatch.setattr(suite, "run_program", lambda *a, **k: run)
    with pytest.raises(RuntimeError, match="did not check out"):
        suite.measure_round(suite.plan(True))
    run.report = None  # a run that wrote none: one line, not a TypeError on None
    with pytest.raises(ReportError, match=r"^`torchrun pipeline_schedules.py` \(exit status 1\): no report$"):
        suite.measure_round(suite.plan(True))
