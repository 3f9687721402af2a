"""``python -m ddpguide.bench pipeline_schedules``: the library's schedules side by side.

One launch of ``book/programs/pipeline_schedules.py`` on 2 ranks, each pinned to a
core of its own with one thread (``--pin-cores``; one stage per rank for GPipe and
1F1B, two for the others, all stages equal), runs every
schedule in turn at the same micro-batches and batch: one step checked against
one process, then timed steps. Each rank reports (in the program's ``--report`` file)
the median step time and the time it spent inside forwards and backwards (busy); the rest of the step it
waited (its bubble). For each schedule the suite reports idle over busy time,
averaged over the ranks, next to the count from the action list
(:func:`ddpguide.pipeline.zoo.simulate`): ``bubble_measured_over_formula``.
``interleaved_over_1f1b`` is 1F1B's step time over Interleaved1F1B's (throughput);
``zb_bubble_over_1f1b_bubble`` InterleavedZeroBubble's measured bubble over
1F1B's. The full run repeats the launch in 2 rounds (medians); ``--quick`` one
round of fewer, smaller steps. The ``pipeline`` suite runs these cases too.
"""

from __future__ import annotations

import os
import statistics
import sys

from ddpguide.bench.report import Report
from ddpguide.launch.programs import run as run_program
from ddpguide.launch.programs import torchrun
from ddpguide.launch.report import failed as failed_checks
from ddpguide.pipeline import zoo

RANKS = 2  # one core each on a 2-core machine: with more ranks than cores, waits are the machine's


def plan(quick: bool) -> dict:
    """The program's arguments: micro-batches, sizes and timed steps."""
    if quick:
        return {"microbatches": 8, "microbatch_size": 16, "width": 128, "time": 3, "rounds": 1}
    return {"microbatches": 8, "microbatch_size": 48, "width": 768, "time": 4, "rounds": 2}


def measure_round(p: dict) -> dict[str, list[tuple[float, float]]]:
    """One launch: per schedule, each rank's (step, busy) seconds."""
    result = run_program(
        "pipeline_schedules.py", "--pin-cores", "--schedule", "all", "--microbatches", str(p["microbatches"]),
        "--microbatch-size", str(p["microbatch_size"]), "--width", str(p["width"]),
        "--steps", "1", "--time", str(p["time"]), launcher=torchrun(RANKS), timeout=1800,
        echo=False, report=True)
    assert result.report is not None  # report=True and exit status 0
    found = {run["schedule"]: [(r["step_seconds"], r["busy_seconds"]) for r in run["ranks"]]
             for run in result.report["runs"]}
    failed = failed_checks(result.report)
    if failed or any(len(v) != RANKS for v in found.values()) or len(found) != len(zoo.SCHEDULES):
        raise RuntimeError("the schedules' run did not check out:\n" + "\n".join(result.lines()[-20:]))
    return found


def measure(quick: bool) -> tuple[dict, dict]:
    """Median step and bubble per schedule over the rounds (progress on stderr)."""
    from tqdm import tqdm

    p = plan(quick)
    steps: dict[str, list[float]] = {s: [] for s in zoo.SCHEDULES}
    bubbles: dict[str, list[float]] = {s: [] for s in zoo.SCHEDULES}
    for round_ in tqdm(range(p["rounds"]), desc="pipeline schedules, rounds", file=sys.stderr):
        for schedule, ranks in measure_round(p).items():
            step = statistics.median(s for s, _ in ranks)
            bubble = statistics.mean((s - b) / b for s, b in ranks)
            steps[schedule].append(step)
            bubbles[schedule].append(bubble)
            print(f"round {round_ + 1}: {schedule}: step {step * 1e3:.1f} ms, measured bubble "
                  f"{bubble:.3f} (counted {float(zoo.simulate(schedule, RANKS, p['microbatches']).bubble):.3f})",
                  file=sys.stderr, flush=True)
    return p, {"steps": steps, "bubbles": bubbles}


def add_to(report: Report, quick: bool) -> None:
    """Measure the schedules and add their figures and ratios to ``report``."""
    p, res = measure(quick)
    m = p["microbatches"]
    case = (f"{RANKS} ranks, 8 blocks x {p['width']} features, float64, m={m} micro-batches of "
            f"{p['microbatch_size']}, {p['time']} timed steps x {p['rounds']} rounds")
    bubble = {}
    for schedule in zoo.SCHEDULES:
        counted = zoo.simulate(schedule, RANKS, m).bubble
        step = statistics.median(res["steps"][schedule])
        bubble[schedule] = statistics.median(res["bubbles"][schedule])
        report.add(f"{schedule}: step time", step * 1e3, "ms/step", case=case,
                   samples=[s * 1e3 for s in res["steps"][schedule]])
        report.add(f"{schedule}: idle / busy time, measured", bubble[schedule], "ratio",
                   case=case, counted=float(counted), formula=str(zoo.bubble_formula(schedule, RANKS, m)))
        if counted:
            report.add_ratio(f"bubble_measured_over_formula_{schedule}",
                             [b / float(counted) for b in res["bubbles"][schedule]])
    report.add_ratio("interleaved_over_1f1b", [a / b for a, b in zip(
        res["steps"]["1F1B"], res["steps"]["Interleaved1F1B"])])
    report.add_ratio("zb_bubble_over_1f1b_bubble", [a / b for a, b in zip(
        res["bubbles"]["InterleavedZeroBubble"], res["bubbles"]["1F1B"])])
    report.add_ratio("zbv_bubble_over_1f1b_bubble", [a / b for a, b in zip(
        res["bubbles"]["ZBVZeroBubble"], res["bubbles"]["1F1B"])])
    report.notes.append(
        f"schedules: {RANKS} processes, each pinned to a core of its own with one thread "
        f"(--pin-cores), on {os.cpu_count()} cores; a rank's bubble is its step time minus the time "
        "inside forwards and backwards, over the latter, so sends, receives and the schedule's own "
        "Python count as idle; counted bubbles come from the action lists with unit costs "
        "(F = I = W = 1, B = 2). With more ranks than cores (4 on 2) a rank computes at most half "
        "of the time, so idle/busy is at least 1 whatever the schedule: that run cannot tell the "
        "schedules' bubbles apart")


def run(quick: bool = False) -> Report:
    """The schedules alone (the ``pipeline`` suite adds the same cases to its own)."""
    report = Report("pipeline_schedules")
    load_before = os.getloadavg()[0]
    add_to(report, quick)
    report.notes.append(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
                        f"on {os.cpu_count()} cores: other programs distort the times")
    return report
