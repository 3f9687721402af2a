"""The checkpoint-interval model of chapter 17 against its closed forms."""

from __future__ import annotations

import math
import random

import pytest

from ddpguide.failures import cadence


def test_without_failures_goodput_is_the_checkpoints_stall_only():
    out = cadence.simulate(step_s=0.1, cost_s=0.5, mtbf_s=1e12, restart_s=3.0, interval=10,
                           useful_steps=1000, seed=0)
    assert out["failures"] == 0
    assert out["goodput"] == pytest.approx(1.0 / (1.0 + 0.5), rel=1e-12)  # 10 steps = 1 s, + 0.5 s


def step_by_step(step_s, cost_s, mtbf_s, restart_s, interval, useful_steps, seed):
    """The same loop one step at a time: the reference the event-by-event simulation meets."""
    rng = random.Random(seed)
    clock, kept, since, failures, lost = 0.0, 0, 0, 0, 0.0
    failure_at = rng.expovariate(1 / mtbf_s)
    while kept < useful_steps:
        done_at = clock + step_s + (cost_s if since + 1 == interval else 0.0)
        if failure_at < done_at:                      # inside this step or its save
            failures += 1
            lost += failure_at - clock + since * step_s + restart_s
            kept, since = kept - since, 0
            clock = failure_at + restart_s
            failure_at = clock + rng.expovariate(1 / mtbf_s)
            continue
        clock, kept, since = done_at, kept + 1, (since + 1) % interval
    return {"goodput": useful_steps * step_s / clock, "failures": failures,
            "lost_per_failure_s": lost / failures if failures else 0.0}


@pytest.mark.parametrize("case", [(0.05, 0.2, 60.0, 2.0, 40, 20_000, 1),
                                  (0.1, 0.5, 5.0, 1.0, 7, 5_000, 3)])
def test_the_simulation_equals_the_loop_step_by_step(case):
    fast, slow = cadence.simulate(*case), step_by_step(*case)
    assert fast["failures"] == slow["failures"] > 10
    for key in ("goodput", "lost_per_failure_s"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-9)


def test_the_best_interval_is_young_dalys_and_a_failure_costs_tau_half_plus_restart():
    sweep = cadence.sweep(0.05, 0.2, 60.0, 2.0)
    assert sweep["predicted_s"] == pytest.approx(math.sqrt(2 * 0.2 * 60.0))
    assert 0.67 <= sweep["best_over_predicted"] <= 1.5
    best = sweep["best"]
    assert best["lost_predicted_s"] == pytest.approx(best["tau_s"] / 2 + 2.0)
    assert 0.8 <= best["lost_per_failure_s"] / best["lost_predicted_s"] <= 1.2
    goodputs = [r["goodput"] for r in sweep["rows"]]
    assert goodputs[0] < best["goodput"] > goodputs[-1]  # a maximum inside the sweep


@pytest.mark.parametrize("mtbf_min, published_min, within", [(24 * 60, 117, 0.5), (6 * 60, 57, 0.5),
                                                           (15, 9.1, 0.05)])
def test_dalys_optimum_gives_the_intervals_his_paper_prints(mtbf_min, published_min, within):
    """Daly 2006, figures 3-5: dump time 5 min, M = 24 h, 6 h, 15 min."""
    assert abs(cadence.daly_s(5.0, mtbf_min) - published_min) <= within
    assert cadence.daly_s(5.0, 2.0) == 2.0                    # C >= 2M: M itself


def test_with_c_near_m_the_simulated_best_interval_is_dalys_not_youngs():
    """C = 20 s, M = 60 s: Young's sqrt(2CM) = 49 s, Daly's 36.6 s; the simulated loop's best
    (intervals of 0.5 s) is within 10% of Daly's and below Young's by more than 15%."""
    sweep = cadence.sweep(0.05, 20.0, 60.0, 5.0, intervals=list(range(500, 1000, 10)),
                          useful_steps=400_000, seeds=8)
    assert sweep["daly_s"] == pytest.approx(36.56, abs=0.01)
    assert abs(sweep["best_over_daly"] - 1) < 0.1 and sweep["best_over_predicted"] < 0.85


def test_checkpoint_cost_is_measured_and_the_async_save_finishes_after_its_stall():
    cost = cadence.checkpoint_cost(megabytes=1, repeats=1)
    assert cost["megabytes"] == 1
    assert 0 < cost["async_stall_s"] <= cost["async_total_s"]
    assert cost["sync_s"] > 0


def test_per_step_goodput():
    assert cadence.per_step_goodput(0.05, 60.0, 1.2) == pytest.approx(0.98)
    assert cadence.per_step_goodput(0.05, 1.0, 5.0) == 0.0
