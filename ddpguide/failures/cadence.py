"""How often to checkpoint: the cost C measured, failures modelled, goodput over intervals.

Measured: C, the seconds a save costs, with ``torch.distributed.checkpoint.save`` (the loop
waits for all of it) and with ``dcp.async_save`` (the loop waits only for the copy into
memory, its stall; the write goes on in the background, its total). Modelled, on a simulated
clock: a training loop of ``step_s`` seconds per step, a checkpoint every ``interval`` steps
that stalls it ``C`` seconds, failures arriving as a Poisson process of mean ``M`` seconds,
and, after each failure, ``R`` seconds of restart and the steps since the last checkpoint done
again. Young's first-order optimum for that loop (Young 1974) is ``sqrt(2 C M)`` seconds of
work between checkpoints; Daly's higher-order one (Daly 2006, "A higher order estimate of the
optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22,
doi:10.1016/j.future.2004.11.016) is ``sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C``
for ``C < 2M``, and ``M`` otherwise. The two agree while C is much smaller than M and part
as C grows towards it. The expected work lost per failure is ``tau / 2 + R``.

The best interval of ``sweep`` is found on that simulated clock, not measured on a training
run: only C is measured. It tests the simulator against the two formulas.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch


def checkpoint_cost(megabytes: int = 32, repeats: int = 3) -> dict[str, float]:
    """Median seconds of a synchronous DCP save, and of an async save's stall and total."""
    import torch.distributed.checkpoint as dcp

    numel = megabytes * 2**20 // 8
    state = {"model": {f"w{i}": torch.randn(numel // 4, dtype=torch.float64) for i in range(4)}}
    sync, stall, total = [], [], []
    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="ddpguide-dcp-") as folder:
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=f"{folder}/sync")
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            future: Any = dcp.async_save(state, checkpoint_id=f"{folder}/async")
            stall.append(time.perf_counter() - t0)
            future.result()
            total.append(time.perf_counter() - t0)
    return {"megabytes": megabytes, "sync_s": statistics.median(sync),
            "async_stall_s": statistics.median(stall), "async_total_s": statistics.median(total)}


def simulate(step_s: float, cost_s: float, mtbf_s: float, restart_s: float, interval: int,
             useful_steps: int, seed: int) -> dict[str, float]:
    """The loop above on a simulated clock until ``useful_steps`` steps are kept.

    Event by event, not step by step: between two failures the loop runs whole periods of
    ``interval`` steps and a save (``interval * step_s + cost_s`` seconds each); a failure
    loses what was done since the period began and costs ``restart_s``. (A failure at the
    very end of a period, as its save completes, loses nothing.) Returns the goodput (kept
    steps' seconds over all seconds), the failures, and the mean seconds lost per failure
    (the partial period redone, and the restart)."""
    rng = random.Random(seed)
    period = interval * step_s + cost_s
    clock, kept, failures, lost = 0.0, 0, 0, 0.0
    while True:
        gap = rng.expovariate(1 / mtbf_s)            # from this start to the next failure
        left = useful_steps - kept
        finish = left * step_s + (left // interval) * cost_s
        if gap >= finish:                             # done before the failure
            clock += finish
            break
        periods = math.floor(gap / period)
        kept += periods * interval
        failures += 1
        lost += gap - periods * period + restart_s
        clock += gap + restart_s
    return {"goodput": useful_steps * step_s / clock, "failures": failures,
            "lost_per_failure_s": lost / failures if failures else 0.0}


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Young's sqrt(2 C M): seconds of work between checkpoints."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (module docstring): seconds of work between checkpoints."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return young_daly_s(cost_s, mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def sweep(step_s: float, cost_s: float, mtbf_s: float, restart_s: float,
          intervals: list[int] | None = None, useful_steps: int = 1_000_000,
          seeds: int = 4) -> dict:
    """Goodput for each checkpoint interval (steps), averaged over ``seeds`` runs; the best
    interval (simulated) against Young's and Daly's, and the lost work per failure against
    tau/2 + R."""
    predicted = young_daly_s(cost_s, mtbf_s)
    if intervals is None:
        centre = predicted / step_s
        intervals = sorted({max(1, round(centre * 2 ** (k / 4))) for k in range(-12, 13)})
    rows = []
    for interval in intervals:
        runs = [simulate(step_s, cost_s, mtbf_s, restart_s, interval, useful_steps, s)
                for s in range(seeds)]
        tau = interval * step_s + cost_s
        rows.append({"interval_steps": interval, "tau_s": tau,
                     "goodput": statistics.mean(r["goodput"] for r in runs),
                     "lost_per_failure_s": statistics.mean(r["lost_per_failure_s"] for r in runs),
                     "lost_predicted_s": tau / 2 + restart_s})
    best = max(rows, key=lambda r: r["goodput"])
    daly = daly_s(cost_s, mtbf_s)
    return {"rows": rows, "best": best, "predicted_s": predicted, "daly_s": daly,
            "best_over_predicted": best["interval_steps"] * step_s / predicted,
            "best_over_daly": best["interval_steps"] * step_s / daly}


def per_step_goodput(step_s: float, mtbf_s: float, lost_per_failure_s: float) -> float:
    """With per-step fault tolerance nothing is redone from a checkpoint: a failure costs the
    survivors ``lost_per_failure_s`` (one step and the new quorum, measured) and no save stalls
    the loop: goodput = 1 - lost / M, to first order."""
    return max(0.0, 1.0 - lost_per_failure_s / mtbf_s)
