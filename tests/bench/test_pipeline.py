"""The pipeline benchmark: the full plan is the source's sweep; medians, ranges and the saved chart."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from ddpguide.bench import pipeline as bench  # noqa: E402
from ddpguide.bench.pipeline_cases import BALANCED, BASELINES, Case  # noqa: E402
from ddpguide.bench.pipeline_report import (  # noqa: E402
    pipeline_rows,
    plot_saved_sweep,
    spread,
    sweep_from_report,
)
from ddpguide.bench.report import Report  # noqa: E402


def test_the_full_plan_sweeps_the_seeds_split_sizes_at_batch_120_with_repeats():
    plan = bench.make_plan(quick=False)
    assert (plan.image_size, plan.batch) == (128, 120)
    assert plan.sizes == (1, 3, 5, 8, 10, 12, 20, 40, 60)
    assert all(plan.batch % s == 0 for s in plan.sizes)
    assert plan.rounds * plan.repeats >= 5
    pipelined = [c.split_size for c in plan.cases() if (c.schedule, c.split_point) == ("1f1b", "layer3.0")]
    assert pipelined == list(plan.sizes)


def test_the_quick_plan_stays_small():
    plan = bench.make_plan(quick=True)
    assert (plan.image_size, plan.batch, plan.sizes) == (64, 64, (16, 32))
    assert len(plan.cases()) <= 8 and plan.rounds * plan.repeats <= 2


def test_spread_is_the_median_and_the_range_of_the_timed_steps():
    assert spread([0.3, 0.1, 0.2, 0.9]) == {"seconds": pytest.approx(0.25), "low": 0.1,
                                           "high": 0.9, "steps_timed": 4}


def measured():
    cases = [*BASELINES, Case("pipeline", "1f1b", 20), Case("pipeline", "1f1b", 60),
             Case("pipeline", "1f1b", 20, BALANCED)]
    samples = dict(zip(cases, ([2.0, 2.2, 2.1], [2.1, 2.3, 2.2], [1.2, 1.4, 1.1],
                               [1.5, 1.3, 1.4], [1.8, 1.9, 2.4], [1.25, 1.3, 1.35])))
    return {"samples": samples, "balanced": "layer2.3"}


def test_rows_carry_median_and_range_with_the_balanced_cut_resolved():
    rows = {(r["split_size"], r["split_point"]): r for r in pipeline_rows(measured())}
    assert set(rows) == {(20, "layer3.0"), (60, "layer3.0"), (20, "layer2.3")}
    assert rows[(60, "layer3.0")] == {"schedule": "1f1b", "split_size": 60, "split_point": "layer3.0",
                                      "seconds": 1.9, "low": 1.8, "high": 2.4, "steps_timed": 3}


def test_a_saved_report_gives_back_the_sweep_and_draws_it_with_error_bars(tmp_path):
    m = measured()
    report = Report("pipeline")
    for c in BASELINES:
        report.add(c.name("x"), spread(m["samples"][c])["seconds"] * 1e3, "ms/step", case="ResNet50",
                   kind=c.kind, **spread(m["samples"][c]))
    for r in pipeline_rows(m):
        report.add(f"pipeline {r['split_size']}", r["seconds"] * 1e3, "ms/step", case="ResNet50", **r)
    report.write_json(tmp_path / "pipeline.json")
    saved = json.loads((tmp_path / "pipeline.json").read_text())
    rows, baselines, ranges, title = sweep_from_report(saved)
    assert title == "ResNet50" and len(rows) == 3
    assert baselines == {"single": 2.1, "model_parallel": 2.2, "threads2": 1.2}
    assert ranges["single"] == (2.0, 2.2)
    fig = plot_saved_sweep(saved)
    ax = fig.axes[0]
    # one error-bar container per (schedule, split point), each bar spanning min..max
    assert len(ax.containers) == 2
    seed_line = next(c for c in ax.containers if "layer3.0" in c.get_label())
    segments = seed_line.lines[2][0].get_segments()
    assert sorted((s[0][1], s[1][1]) for s in segments) == [(1.3, 1.5), (1.8, 2.4)]
