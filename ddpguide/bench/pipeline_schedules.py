"""``python -m ddpguide.bench pipeline_schedules``: the library's schedules side by side.

One launch of ``book/programs/pipeline_schedules.py`` on 2 ranks, each pinned to a
core of its own with one thread (``--pin-cores``; one stage per rank for GPipe and
1F1B, two for the others, all stages equal), runs every schedule in turn at the same
micro-batches and batch: one step checked against one process, then timed steps.

**What the bubble is measured as.** In a timed step every rank records when each of
its forwards and backwards (F, B, I, W) starts and ends, on a clock started at a
barrier before the step. The step runs from the first compute on any rank to the
last; a rank idles whatever of it it does not compute (waits, sends, receives, the
schedule's own code). The bubble is the idle time over the busy time, all ranks
together: the definition of :attr:`ddpguide.pipeline.timeline.Timeline.bubble`, which
the count from the action lists uses (:func:`ddpguide.pipeline.zoo.simulate`).

**Which steps count.** Each rank also reads how much CPU time other processes took on
its core during the step (``/proc/stat``, less its own process's): their work makes it
wait, and the wait passes for a bubble. A step counts only if that time is at most
:data:`QUIET` of the step on every rank (the counters tick every 10 ms, hence the 2 %
at steps of about 2 s). Per schedule and round the suite takes the
median over the counted steps (over all steps, flagged in the notes, when none
counts), and reports ``bubble_measured_over_formula_<schedule>`` (the closed form,
:func:`ddpguide.pipeline.zoo.bubble_formula`, equal to the count at m = 4 on 2 ranks),
``zb_bubble_over_1f1b_bubble`` (InterleavedZeroBubble's over 1F1B's, counted 1/6),
``zbv_bubble_over_1f1b_bubble``, ``interleaved_over_1f1b`` (1F1B's step time over
Interleaved1F1B's) and ``quiet_step_share``. The full run repeats the launch in 3 rounds
(medians); ``--quick`` one round of fewer, smaller steps. The ``pipeline`` suite runs
these cases too.
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
from ddpguide.pipeline.timeline import Costs

RANKS = 2  # one core each on a 2-core machine: with more ranks than cores, waits are the machine's
QUIET = 0.02  # a step counts if other processes took at most this share of it on every rank's core


def plan(quick: bool) -> dict:
    """The program's arguments: micro-batches, sizes and timed steps."""
    if quick:
        return {"microbatches": 4, "blocks": 8, "microbatch_size": 16, "width": 256, "time": 3, "rounds": 1}
    # a chunk's forward (8 blocks of 256 x 1024 x 1024) against a 2 MB transfer: the sends
    # and the schedule's own code stay a small part of the counted idle; F, I and W (one
    # matrix product each) cost about the same at 256 rows
    return {"microbatches": 4, "blocks": 32, "microbatch_size": 256, "width": 1024, "time": 5, "rounds": 3}


def measure_round(p: dict) -> dict[str, dict]:
    """One launch: per schedule, the program's ``timed`` summary (every timed step, the costs)."""
    result = run_program(
        "pipeline_schedules.py", "--pin-cores", "--schedule", "all", "--microbatches", str(p["microbatches"]),
        "--blocks", str(p["blocks"]), "--microbatch-size", str(p["microbatch_size"]), "--width", str(p["width"]),
        "--steps", "1", "--time", str(p["time"]), launcher=torchrun(RANKS), timeout=1800,
        echo=False, report=True)
    report = result.reported()
    found = {run["schedule"]: run.get("timed") for run in report["runs"]}
    failed = failed_checks(report)
    if failed or any(t is None or len(t["steps"]) != p["time"] for t in found.values()) \
            or len(found) != len(zoo.SCHEDULES):
        raise RuntimeError("the schedules' run did not check out:\n" + "\n".join(result.lines()[-20:]))
    return found


def quiet(step: dict) -> bool:
    """Other processes took at most QUIET of the step on every rank's core (unknown: counted)."""
    return all(o is None or o <= QUIET * step["seconds"] for o in step["others_on_core"])


def summarise(timed: dict) -> dict:
    """One round of one schedule: the median bubble and step over its quiet steps (or all)."""
    steps = [s for s in timed["steps"] if quiet(s)]
    used = steps or timed["steps"]
    return {"bubble": statistics.median(s["bubble"] for s in used),
            "seconds": statistics.median(s["seconds"] for s in used),
            "quiet": len(steps), "steps": len(timed["steps"]), "costs": timed["costs"]}


def costs_in_units(costs: dict[str, float], resolution: int = 10) -> Costs:
    """The measured seconds per chunk as whole time units (the cheapest kind = ``resolution``).

    F, I, W and B are the medians over the stages; stage 0's I and W are left out (the
    library runs the first stage's whole backward in W, its I does nothing).
    """
    def median(kind: str, skip_first: bool = False) -> float | None:
        values = [v for k, v in costs.items() if k[0] == kind and not (skip_first and k[1:] == "0")]
        return statistics.median(values) if values else None

    f, i, w, b = median("F") or 1.0, median("I", True), median("W", True), median("B")
    if i is None or w is None:  # a schedule without the split backward: B only
        i = w = (b or 2 * f) / 2
    unit = min(x for x in (f, i, w) if x) / resolution
    return Costs(F=max(1, round(f / unit)), I=max(1, round(i / unit)), W=max(1, round(w / unit)),
                 B=None if b is None else max(1, round(b / unit)))


def measure(quick: bool) -> tuple[dict, dict[str, list[dict]]]:
    """Every round's summary per schedule (progress on stderr)."""
    from tqdm import tqdm

    p = plan(quick)
    rounds: dict[str, list[dict]] = {s: [] for s in zoo.SCHEDULES}
    for round_ in tqdm(range(p["rounds"]), desc="pipeline schedules, rounds", file=sys.stderr):
        for schedule, timed in measure_round(p).items():
            found = summarise(timed)
            rounds[schedule].append(found)
            formula = float(zoo.bubble_formula(schedule, RANKS, p["microbatches"]))
            print(f"round {round_ + 1}: {schedule}: step {found['seconds'] * 1e3:.1f} ms, measured bubble "
                  f"{found['bubble']:.4f} (formula {formula:.4f}), {found['quiet']} of {found['steps']} "
                  "steps quiet", file=sys.stderr, flush=True)
    return p, rounds


def add_to(report: Report, quick: bool) -> None:
    """Measure the schedules and add their figures and ratios to ``report``."""
    p, rounds = measure(quick)
    m = p["microbatches"]
    case = (f"{RANKS} ranks, {p['blocks']} blocks x {p['width']} features, float64, m={m} micro-batches of "
            f"{p['microbatch_size']}, {p['time']} timed steps x {p['rounds']} rounds")
    bubbles = {s: [r["bubble"] for r in found] for s, found in rounds.items()}
    steps = {s: [r["seconds"] for r in found] for s, found in rounds.items()}
    for schedule, found in rounds.items():
        formula = zoo.bubble_formula(schedule, RANKS, m)
        costs = costs_in_units(found[-1]["costs"])
        report.add(f"{schedule}: step time", statistics.median(steps[schedule]) * 1e3, "ms/step", case=case,
                   samples=[s * 1e3 for s in steps[schedule]])
        report.add(f"{schedule}: idle / busy time, measured", statistics.median(bubbles[schedule]), "ratio",
                   case=case, samples=bubbles[schedule], formula=str(formula),
                   counted=float(zoo.simulate(schedule, RANKS, m).bubble),
                   counted_at_measured_costs=float(zoo.simulate(schedule, RANKS, m, costs).bubble),
                   measured_costs=f"F {costs.F}, I {costs.I}, W {costs.W}, B {costs.of('B')}",
                   ms_per_chunk={k: round(v * 1e3, 3) for k, v in found[-1]["costs"].items()},
                   quiet_steps=sum(r["quiet"] for r in found), steps=sum(r["steps"] for r in found))
        report.add_ratio(f"bubble_measured_over_formula_{schedule}", [b / float(formula) for b in bubbles[schedule]])
    report.add_ratio("interleaved_over_1f1b", [a / b for a, b in zip(steps["1F1B"], steps["Interleaved1F1B"])])
    report.add_ratio("zb_bubble_over_1f1b_bubble", [a / b for a, b in zip(
        bubbles["InterleavedZeroBubble"], bubbles["1F1B"])])
    report.add_ratio("zbv_bubble_over_1f1b_bubble", [a / b for a, b in zip(
        bubbles["ZBVZeroBubble"], bubbles["1F1B"])])
    quiet_steps = sum(r["quiet"] for found in rounds.values() for r in found)
    all_steps = sum(r["steps"] for found in rounds.values() for r in found)
    report.ratios["quiet_step_share"] = quiet_steps / all_steps
    report.notes.append(
        f"schedules: {RANKS} processes, each pinned to a core of its own with one thread "
        f"(--pin-cores), on {os.cpu_count()} cores. A step runs from the first forward or backward on "
        "any rank to the last (each rank's clock starts at a barrier before the step); a rank idles "
        "what it does not compute of it, so sends, receives and the schedule's own Python count as "
        "idle; bubble = idle over busy time, all ranks together, as counted on the action lists. "
        f"Only steps in which other processes took at most {QUIET:.0%} of the step on every rank's core count "
        f"({quiet_steps} of {all_steps} here)"
        + ("" if quiet_steps else ": none did, so every figure here is the machine's, not the schedule's")
        + ". With more ranks than cores (4 on 2) a rank computes at most half of the time, so "
        "idle/busy is at least 1 whatever the schedule: such a run cannot tell the schedules' "
        "bubbles apart")


def run(quick: bool = False) -> Report:
    """The schedules alone (the ``pipeline`` suite adds the same cases to its own)."""
    report = Report("pipeline_schedules")
    load_before = os.getloadavg()[0]
    add_to(report, quick)
    report.notes.append(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
                        f"on {os.cpu_count()} cores: other programs distort the times")
    return report
