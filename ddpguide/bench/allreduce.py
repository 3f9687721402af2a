"""Hand-written all-reduce vs gloo's, 2 and 4 ranks, 4 KB to 64 MB, side by side in one run.

``python -m ddpguide.bench allreduce [--quick] [--json FILE]``

Cases: ``gloo`` (``dist.all_reduce``), and the algorithms of
:mod:`ddpguide.collectives.algorithms`: ``naive``, ``ring`` (one message per step),
``pipelined_ring`` (segments in flight) and ``recursive_doubling``. The
headline ``hand`` figure is the algorithm that ``collectives.all_reduce``
chooses for that size (:func:`~ddpguide.collectives.algorithms.choose_algorithm`); the
table says which one that was. Times are medians over repeats of the slowest
rank; algorithmic bandwidth is ``bytes / time`` (the convention of nccl-tests),
bus bandwidth multiplies it by the ring's ``2 (N-1) / N``.

A full run measures each world size in three process groups, one after the
other: with more processes than cores, how fast gloo's own all-reduce runs
depends on how its threads happen to share the cores, and that is settled
when the group starts (on a 2-core machine, 4 ranks at 64 MB took either about
90 ms or about 130 ms for a whole group). Every ratio is computed within one
group, where all cases ran side by side, and the report gives the median over
the groups and the range.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Mapping

import torch
import torch.distributed as dist

from ddpguide.bench.progress import tick, tracked
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.collectives import algorithms as collectives
from ddpguide.core.runtime import worker_device
from ddpguide.launch.spawn import spawn

KIB, MIB = 2**10, 2**20
SIZES = [4 * KIB * 4**k for k in range(8)]  # 4 KB ... 64 MB
QUICK_SIZES = [4 * KIB, 64 * KIB, MIB, 64 * MIB]
WORLD_SIZES = (2, 4)
CASES = ("gloo", "naive", "ring", "pipelined_ring", "recursive_doubling")
# (ratio name, ranks, bytes): the hand-written choice's time over gloo's
HEADLINES = (("ring_over_gloo_64mb", 2, 64 * MIB), ("ring_over_gloo_64mb_4ranks", 4, 64 * MIB),
             ("ring_over_gloo_1mb_4ranks", 4, MIB))


def _run_case(case: str, tensor: torch.Tensor) -> None:
    if case == "gloo":
        dist.all_reduce(tensor)
    else:
        collectives.all_reduce(tensor, algorithm=case)


def measure(sizes: list[int], repeats: int, cases: tuple[str, ...] = CASES,
            small_samples: int = 30) -> dict[int, dict[str, float]]:
    """Worker: median seconds per float32 all-reduce, ``{bytes: {case: seconds}}``.

    Each case is first run once and its sum checked. Every sample is one call
    that all ranks start together (after a barrier), timed on each rank; the
    sample is the slowest rank's time. The cases take turns within every repeat
    so that a noisy machine slows them alike. Messages up to 1 MB are cheap and
    their latency is noisy (a rank that loses its core waits a scheduler tick,
    milliseconds), so they get at least ``small_samples`` samples.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), worker_device()
    # GPU work is asynchronous: wait for it before reading the clock.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    expected = world * (world + 1) / 2
    out: dict[int, dict[str, float]] = {}
    for nbytes in sizes:
        tensor = torch.empty(max(1, nbytes // 4), device=device)
        for case in cases:
            tensor.fill_(rank + 1)
            _run_case(case, tensor)
            if not torch.all(tensor == expected):
                raise AssertionError(f"{case} all-reduce gave a wrong sum at {nbytes} bytes")
        tensor.zero_()  # repeated sums of zeros stay finite
        samples: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(max(small_samples, repeats) if nbytes <= MIB else repeats):
            for case in cases:
                dist.barrier()
                start = time.perf_counter()
                _run_case(case, tensor)
                sync()
                samples[case].append(time.perf_counter() - start)
        times = torch.tensor([samples[c] for c in cases], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call is as slow as its slowest rank
        out[nbytes] = {c: statistics.median(times[i].tolist()) for i, c in enumerate(cases)}
        if rank == 0:  # one case of the suite's progress (nothing happens outside the suite)
            label = f"{world} ranks, {size_label(nbytes)}"
            tick(label, [(f"{c}, {label}", out[nbytes][c] * 1e6, "us") for c in cases])
    return out


def bytes_sent(case: str, nbytes: int, world: int) -> float:
    """Bytes sent by the busiest rank in one all-reduce of ``nbytes`` (gloo: a ring)."""
    if case in ("gloo", "ring", "pipelined_ring"):
        return 2 * (world - 1) / world * nbytes
    if case == "naive":
        return (world - 1) * nbytes  # rank 0 sends the sum to everyone
    power = 1 << (world.bit_length() - 1)
    return (int(math.log2(power)) + (world > power)) * nbytes


def size_label(nbytes: int) -> str:
    """``4096`` -> ``'4KB'``, ``2**20`` -> ``'1MB'``."""
    return f"{nbytes // MIB}MB" if nbytes >= MIB else f"{nbytes // KIB}KB"


Measured = dict[int, dict[str, float]]  # {bytes: {case: seconds}}, one process group


def combine_groups(groups: list[Measured]) -> tuple[Measured, Measured]:
    """Median seconds and median ratio to gloo over process groups, per size and case.

    Each ratio is taken within one group (the cases ran side by side there)
    before the median over groups is taken.
    """
    seconds: Measured = {}
    vs_gloo: Measured = {}
    for nbytes in groups[0]:
        cases = groups[0][nbytes]
        seconds[nbytes] = {c: statistics.median(g[nbytes][c] for g in groups) for c in cases}
        vs_gloo[nbytes] = {c: statistics.median(g[nbytes][c] / g[nbytes]["gloo"] for g in groups)
                           for c in cases}
    return seconds, vs_gloo


def build_report(results: Mapping[int, Measured | list[Measured]]) -> Report:
    """The suite's report from ``{ranks: measure(...) result, or a list of them (one per group)}``."""
    report = Report("allreduce")
    groups = {world: r if isinstance(r, list) else [r] for world, r in results.items()}
    combined = {world: combine_groups(g) for world, g in groups.items()}
    for world, (by_size, ratios) in combined.items():
        header = (f"{world} ranks: ms per all-reduce (x gloo's time); hand = collectives.all_reduce"
                  + (f"; medians over {len(groups[world])} process groups"
                     if len(groups[world]) > 1 else ""))
        lines = [header, f"{'size':>6} {'gloo':>8} {'hand':>24} " + " ".join(
            f"{c:>18}" for c in CASES if c != "gloo")]
        for nbytes, times in sorted(by_size.items()):
            chosen = collectives.choose_algorithm(nbytes, world)
            for case, seconds in times.items():
                report.add(f"{world}r {size_label(nbytes)} {case}", seconds * 1e3, "ms",
                           ranks=world, bytes=nbytes, case=case, vs_gloo=ratios[nbytes][case],
                           algbw_GBps=nbytes / seconds / 1e9,
                           busbw_GBps=nbytes / seconds / 1e9 * 2 * (world - 1) / world,
                           bytes_sent_busiest_rank=bytes_sent(case, nbytes, world),
                           chosen_by_hand=(case == chosen))
            hand = f"{times[chosen] * 1e3:.2f} ({ratios[nbytes][chosen]:.2f}x {chosen})"
            others = " ".join(f"{times[c] * 1e3:>9.2f} ({ratios[nbytes][c]:4.2f}x)"
                              for c in CASES if c != "gloo")
            lines.append(f"{size_label(nbytes):>6} {times['gloo'] * 1e3:>8.2f} {hand:>24} {others}")
        lines.append(f"ring traffic: each rank sends and receives 2(N-1)/N = "
                     f"{2 * (world - 1) / world:.2f} x the tensor")
        report.notes.append("\n".join(lines))
    for name, world, nbytes in HEADLINES:
        if nbytes not in combined.get(world, ({}, {}))[1]:
            continue
        chosen = collectives.choose_algorithm(nbytes, world)
        for ratio_name, case in ((name, chosen), (name.replace("ring_", "plain_ring_", 1), "ring")):
            report.ratios[ratio_name] = combined[world][1][nbytes][case]
            per_group = [g[nbytes][case] / g[nbytes]["gloo"] for g in groups[world]]
            if len(per_group) > 1:
                report.notes.append(f"{ratio_name} per process group: "
                                    + ", ".join(f"{r:.2f}" for r in per_group))
    report.notes.append("ring_over_gloo_*: collectives.all_reduce's choice over gloo (lower is "
                        "better); plain_ring_*: the one-message-per-step ring. Indicative only on a "
                        "shared machine.")
    return report


def run(quick: bool = False, sizes: list[int] | None = None,
        world_sizes: tuple[int, ...] = WORLD_SIZES, repeats: int | None = None,
        groups: int | None = None) -> Report:
    """Measure every case for each world size in ``groups`` process groups; build the report."""
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    repeats = repeats or (3 if quick else 10)
    groups = groups or (1 if quick else 3)
    with tracked(Report("allreduce"), total=len(world_sizes) * groups * len(sizes),
                 unit="size"):  # rank 0 of each group ticks once per size
        results = {world: [spawn(measure, world, sizes, repeats, env=MALLOC_ENV, echo=False,
                                 timeout=600)[0] for _ in range(groups)]
                   for world in world_sizes}
    return build_report(results)
