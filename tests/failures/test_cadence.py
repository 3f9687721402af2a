"""The checkpoint-interval model of chapter 17 against its closed forms."""

from __future__ import annotations

import math

import pytest

from ddpguide.failures import cadence


def test_without_failures_goodput_is_the_checkpoints_stall_only():
    out = cadence.simulate(step_s=0.1, cost_s=0.5, mtbf_s=1e12, restart_s=3.0, interval=10,
                           useful_steps=1000, seed=0)
    assert out["failures"] == 0
    assert out["goodput"] == pytest.approx(1.0 / (1.0 + 0.5), rel=1e-12)  # 10 steps = 1 s, + 0.5 s


def test_the_best_interval_is_young_dalys_and_a_failure_costs_tau_half_plus_restart():
    sweep = cadence.sweep(0.05, 0.2, 60.0, 2.0, useful_steps=40_000, seeds=3)
    assert sweep["predicted_s"] == pytest.approx(math.sqrt(2 * 0.2 * 60.0))
    assert 0.67 <= sweep["best_over_predicted"] <= 1.5
    best = sweep["best"]
    assert best["lost_predicted_s"] == pytest.approx(best["tau_s"] / 2 + 2.0)
    assert 0.8 <= best["lost_per_failure_s"] / best["lost_predicted_s"] <= 1.2
    goodputs = [r["goodput"] for r in sweep["rows"]]
    assert goodputs[0] < best["goodput"] > goodputs[-1]  # a maximum inside the sweep


def test_checkpoint_cost_is_measured_and_the_async_save_finishes_after_its_stall():
    cost = cadence.checkpoint_cost(megabytes=1, repeats=1)
    assert cost["megabytes"] == 1
    assert 0 < cost["async_stall_s"] <= cost["async_total_s"]
    assert cost["sync_s"] > 0


def test_per_step_goodput():
    assert cadence.per_step_goodput(0.05, 60.0, 1.2) == pytest.approx(0.98)
    assert cadence.per_step_goodput(0.05, 1.0, 5.0) == 0.0
