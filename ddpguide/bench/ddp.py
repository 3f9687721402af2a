"""``python -m ddpguide.bench ddp``: how much faster than the plain script, and what DDP costs.

The reader's question is "how much faster than my plain training script is DDP on two
ranks?": the headline ``ddp2_over_plain``, read against what two cores can give at best
(``independent2_speedup``: two plain processes that never communicate).

Every figure is measured two ways:

* **interleaved**, the figures the suite trusts: two processes hold every case and
  alternate them step by step (:func:`.ddp_steps.interleaved_worker`): the plain loop,
  DDP on a one-rank group and DDP with each of its options that can make it cheaper
  (on rank 0, rank 1 idle), then two independent plain loops and DDP on both ranks.
  A burst of load from elsewhere hits neighbouring steps of every case; the one-rank
  cases share one process, allocator and memory layout. Each round gives one ratio,
  and the spread over rounds is printed beside the median;
* **separate processes** (names ending ``_separate``), as the suite first measured:
  one set of processes per case, one median per process, one ratio per round of
  processes, minutes apart. They add the differences between processes (where their
  memory lands, what else ran at that minute) to what is measured.

Two threads in one process and the toy model are measured the second way only. Every
ratio is the median of its per-round values.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import TypedDict

from ddpguide.bench.ddp_steps import (
    BOTH_RANKS,
    ddp_options,
    interleaved_worker,
    rotated,
    step_time_worker,
    supported_variants,
)
from ddpguide.bench.progress import tick, tracked
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.launch.spawn import spawn

BATCH = 256
TOY_BATCH = 64


class _Where(TypedDict):
    """The keyword arguments of :func:`spawn` that choose the backend and the device."""

    backend: str
    device_type: str


#: The suite measures CPU cores (threads, processes sharing them), also on a machine
#: with GPUs, where the processes would otherwise get nccl and a GPU each.
ON_CPU: _Where = {"backend": "gloo", "device_type": "cpu"}


@dataclass(frozen=True)
class Settings:
    """How much each measurement repeats, and on what."""

    step_rounds: int     # interleaved rounds: one step of every case each
    warmup: int          # untimed steps (interleaved: rounds) before any timing
    process_rounds: int  # rounds of the separate-process cases
    steps: int           # steps per timed block in a separate process
    repeats: int         # timed blocks per process (the process reports their median)
    toy_steps: int       # the same for the toy model, whose step takes microseconds
    batch: int = BATCH   # samples per rank per step (ConvNet; the toy model: TOY_BATCH)
    #: each case's processes fresh interpreters with the allocator settings of MALLOC_ENV
    #: (else forked from the warm server, with this process's own)
    allocator: bool = True


#: ``--quick``: every case and ratio of the full run on a tiny batch, in ranks forked warm;
#: it shows that the suite runs and what it reports, its times say little.
QUICK = Settings(step_rounds=12, warmup=2, process_rounds=1, steps=3, repeats=1, toy_steps=200,
                 batch=8, allocator=False)
FULL = Settings(step_rounds=60, warmup=3, process_rounds=5, steps=8, repeats=3, toy_steps=1000)

#: Cases timed in their own processes: model, processes, threads per process, DDP
#: variant (None: the plain loop; two plain processes never communicate).
PROCESS_CASES: dict[str, tuple[str, int, int, str | None]] = {
    "plain": ("convnet", 1, 1, None),
    "ddp1": ("convnet", 1, 1, "ddp"),
    "ddp2": ("convnet", 2, 1, "ddp"),
    "independent": ("convnet", 2, 1, None),
    "threads2": ("convnet", 1, 2, None),
    "toy1": ("toy", 1, 1, "ddp"),
    "toy2": ("toy", 2, 1, "ddp"),
}

#: What each ratio is, as the report's notes state it. ``t`` is seconds per step with
#: the same batch per rank, so N ranks process N times the samples per step; a case
#: on two ranks is timed by :func:`pair_time`.
DEFINITIONS = {
    "ddp2_over_plain": "2 t_plain / t_ddp2: samples/s of DDP on 2 ranks x 1 thread over the plain "
                       "loop in 1 process x 1 thread, interleaved (the headline)",
    "independent2_speedup": "2 t_plain / t_independent: 2 plain processes that never communicate "
                            "over 1, interleaved (what 2 cores give at best)",
    "ddp2_over_independent2": "t_independent / t_ddp2 = ddp2_over_plain / independent2_speedup "
                              "(the share of the machine's bound DDP reaches)",
    "ddp1_over_plain": "t_ddp / t_plain, DDP on a 1-rank group over the plain loop in the same "
                       "process, interleaved, wall time (1.0 = no overhead)",
    "ddp1_over_plain_cpu": "the same with the process's CPU time per step",
    "ddp1_over_plain_<option>": "DDP with that option over the plain loop, interleaved, wall time",
    "ddp2_speedup": "2 t_ddp / t_ddp2: 2 ranks over DDP on 1 rank, interleaved (any 1-rank "
                    "overhead inflates it)",
    "<ratio>_separate": "the same ratio with each case in its own processes",
    "threads2_speedup": "t_plain / t_threads2: 1 process x 2 threads over 1 thread, separate",
    "ddp2_speedup_toy": "2 t_toy1 / t_toy2: 2 ranks over 1 for the toy model (communication "
                        "dominates), separate",
}


def pair_time(name: str, per_rank: list[float]) -> float:
    """Seconds per step of a case on several ranks. DDP's ranks wait for each other at
    every all-reduce: the slower one sets the pace. Processes that never communicate do
    not wait: their rates add up, and the pair's time is that of their total rate
    (``len / sum(1/t)``, the harmonic mean)."""
    if name == "independent":
        return len(per_rank) / sum(1 / t for t in per_rank)
    return max(per_rank)


def _environment(settings: Settings) -> dict[str, str] | None:
    """The ranks' extra variables: the allocator's (fresh interpreters), or none."""
    return MALLOC_ENV if settings.allocator else None


def _measure(kind: str, processes: int, threads: int, variant: str | None,
             settings: Settings) -> list[float]:
    steps = settings.toy_steps if kind == "toy" else settings.steps
    warmup = 20 if kind == "toy" else settings.warmup
    batch = TOY_BATCH if kind == "toy" else settings.batch
    return spawn(step_time_worker, processes, kind, batch, steps, warmup, variant,
                 settings.repeats, threads_per_rank=threads, env=_environment(settings),
                 echo=False, timeout=600, **ON_CPU)


def measure_processes(settings: Settings) -> dict[str, list[float]]:
    """Seconds per step of each of :data:`PROCESS_CASES` (:func:`pair_time` of its
    ranks), once per round, in round order."""
    names = list(PROCESS_CASES)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(settings.process_rounds):
        for name in rotated(names, r):
            times[name].append(pair_time(name, _measure(*PROCESS_CASES[name], settings)))
            tick(f"{name}, round {r + 1} of {settings.process_rounds}",
                 [(f"{name} (separate processes)", times[name][-1] * 1e3, "ms/step")])
    return times


def combine_ranks(per_rank: list[dict]) -> dict[str, dict[str, list[float]]]:
    """One ``{clock: {case: seconds per round}}`` from :func:`.ddp_steps.interleaved_worker`'s
    results: rank 0's times, and :func:`pair_time` of both ranks' for :data:`BOTH_RANKS`."""
    times = {clock: dict(cases) for clock, cases in per_rank[0]["times"].items()}
    for clock, cases in times.items():
        for name in BOTH_RANKS:
            both = zip(*(r["times"][clock][name] for r in per_rank))
            cases[name] = [pair_time(name, list(t)) for t in both]
    return times


def per_round_ratios(steps: dict[str, dict[str, list[float]]],
                     processes: dict[str, list[float]]) -> dict[str, list[float]]:
    """Every ratio's value in each round (:data:`DEFINITIONS`), the headline first.

    ``steps`` is :func:`combine_ranks`'s ``{clock: {case: seconds per round}}`` with the
    plain loop as ``plain``, DDP's variants by name, ``independent`` and ``ddp2``;
    ``processes`` is :func:`measure_processes`'s ``{case: seconds per round}``.
    """
    def each(numerator: list[float], denominator: list[float], scale: float = 1.0) -> list[float]:
        return [scale * a / b for a, b in zip(numerator, denominator, strict=True)]

    p, wall, cpu = processes, steps["wall"], steps["cpu"]
    ratios = {
        "ddp2_over_plain": each(wall["plain"], wall["ddp2"], 2),
        "independent2_speedup": each(wall["plain"], wall["independent"], 2),
        "ddp2_over_independent2": each(wall["independent"], wall["ddp2"]),
        "ddp1_over_plain": each(wall["ddp"], wall["plain"]),
        "ddp1_over_plain_cpu": each(cpu["ddp"], cpu["plain"]),
    }
    for variant in wall:
        if variant not in ("plain", "ddp", *BOTH_RANKS):
            ratios[f"ddp1_over_plain_{variant}"] = each(wall[variant], wall["plain"])
    ratios["ddp2_speedup"] = each(wall["ddp"], wall["ddp2"], 2)
    ratios["ddp2_over_plain_separate"] = each(p["plain"], p["ddp2"], 2)
    ratios["independent2_speedup_separate"] = each(p["plain"], p["independent"], 2)
    ratios["ddp1_over_plain_separate"] = each(p["ddp1"], p["plain"])
    ratios["threads2_speedup"] = each(p["plain"], p["threads2"])
    ratios["ddp2_speedup_toy"] = each(p["toy1"], p["toy2"], 2)
    return ratios


def verdict(spreads: dict[str, dict[str, float]]) -> list[str]:
    """The notes that read the figures: the headline, and whether the two ways of timing
    agree (each median inside the other's range)."""
    def agree(a: dict[str, float], b: dict[str, float]) -> str:
        same = a["min"] <= b["median"] <= a["max"] and b["min"] <= a["median"] <= b["max"]
        return "they agree." if same else "they disagree."

    def both(name: str) -> str:
        inter, apart = spreads[name], spreads[f"{name}_separate"]
        return (f"{name}: interleaved {inter['median']:.3f} (IQR {inter['q1']:.3f}-"
                f"{inter['q3']:.3f} over {inter['n']} rounds), separate processes "
                f"{apart['median']:.3f} (range {apart['min']:.3f}-{apart['max']:.3f} over "
                f"{apart['n']} rounds): {agree(inter, apart)}")

    head, bound = spreads["ddp2_over_plain"], spreads["independent2_speedup"]
    return [
        f"headline: DDP on 2 ranks x 1 thread trains {head['median']:.2f}x the samples/s of the "
        f"plain loop (1 process x 1 thread); two independent processes reach "
        f"{bound['median']:.2f}x, the bound of this machine.",
        both("ddp1_over_plain"),
        both("ddp2_over_plain"),
        "trusted: the interleaved figures. Their cases alternate step by step, so a moment "
        "of load from elsewhere slows neighbouring steps of every case, and the one-rank "
        "cases share one process; the separate processes run each case minutes apart and "
        "add the differences between processes.",
    ]


def run(quick: bool = False) -> Report:
    """Measure every case and return the report (see the module docstring)."""
    settings = QUICK if quick else FULL
    load_before = os.getloadavg()[0]
    variants = supported_variants()
    report = Report("ddp")
    cases = settings.step_rounds + settings.process_rounds * len(PROCESS_CASES)
    with tracked(report, total=cases):  # the interleaved worker and each process case tick
        per_rank = spawn(interleaved_worker, 2, "convnet", settings.batch, settings.step_rounds,
                         settings.warmup, variants, threads_per_rank=1,
                         env=_environment(settings), echo=False, timeout=600, **ON_CPU)
        steps = combine_ranks(per_rank)
        processes = measure_processes(settings)
    for name, values in per_round_ratios(steps, processes).items():
        report.add_ratio(name, values)

    case = (f"ConvNet 28x28, batch {settings.batch} per rank, CPU and gloo, 1 thread per "
            "process unless named")
    labels = {"plain": "plain loop", "independent": "2 independent processes",
              "ddp2": "DDP, 2 ranks"}
    for name in steps["wall"]:
        label = labels.get(name, f"DDP 1 rank, {name}")
        report.add(f"{label} (interleaved)", statistics.median(steps["wall"][name]) * 1e3,
                   "ms/step", case=case, cpu_ms=statistics.median(steps["cpu"][name]) * 1e3,
                   rounds=settings.step_rounds)
    labels = {
        "plain": "plain loop", "ddp1": "DDP, 1 rank", "ddp2": "DDP, 2 ranks",
        "independent": "2 independent processes", "threads2": "plain loop, 1 process x 2 threads",
        "toy1": "toy model, DDP 1 rank", "toy2": "toy model, DDP 2 ranks",
    }
    for name, values in processes.items():
        kind = PROCESS_CASES[name][0]
        scale, unit = (1e6, "us/step") if kind == "toy" else (1e3, "ms/step")
        report.add(f"{labels[name]} (separate)", statistics.median(values) * scale, unit,
                   case=f"ToyModel, batch {TOY_BATCH} per rank" if kind == "toy" else case,
                   rounds=len(values))

    report.notes += verdict(report.spreads)
    report.notes.append(
        f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{os.cpu_count()} cores: when it exceeds the cores, other programs take turns on them "
        "and wall times swell; the CPU-time ratio (ddp1_over_plain_cpu) suffers least.")
    report.notes.append("each ratio is the median of its per-round values, followed by their "
                        "interquartile range and range; definitions (t: seconds per step, "
                        "same batch per rank; t_ddp2 the slower rank's, t_independent "
                        "2 / (1/t_rank0 + 1/t_rank1), the pair's total rate):")
    report.notes += [f"  {name}: {text}" for name, text in DEFINITIONS.items()]
    report.notes.append("DDP's options, by the name their ratio carries: " + "; ".join(
        f"{v}: {', '.join(f'{k}={o}' for k, o in (ddp_options(v) or {}).items()) or 'defaults'}"
        for v in variants))
    return report
