"""``python -m ddpguide.bench pipeline``: model and pipeline parallelism on this machine.

One run of two processes (one thread each, the same allocator settings) measures
side by side, ResNet50 with random weights, channels-last, SGD:

* one process with one thread running the whole model (the baseline);
* the source's naive model parallelism, both halves on the CPU, one thread;
* the 2-process pipeline (gloo, one stage per process) at the source's split,
  1F1B and GPipe, over a sweep of micro-batch sizes;
* the same with the split point that balances the two stages' measured times;
* one process with two threads (what the two cores give without pipelining).

The one-process cases run on rank 0 while rank 1 waits; all cases run in
interleaved rounds, and each case reports the median of its timed steps with the
fastest and slowest (the chart's error bars). The full run is the source's sweep:
ResNet50 on 128x128 images, batch 120, the 1F1B pipeline at the source's cut for
each of the source's split sizes (:data:`SEED_SPLIT_SIZES`), 2 rounds x 3 timed
steps per case. (The source swept its one-process ``PipelineParallelResNet50`` on
two GPUs; on a CPU only one process per stage overlaps, so that is what is swept.)
``--quick`` uses 64x64 images, batch 64 and micro-batches of 16 and 32, one round
of 2 steps, its ranks without :data:`~ddpguide.bench.report.MALLOC_ENV` (forked warm where
they can be). ``python -m ddpguide.bench.pipeline --image-size 224`` runs at full size.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ddpguide.bench.pipeline_cases import BALANCED, BASELINES, Case, measure
from ddpguide.bench.pipeline_report import (
    pipeline_rows,
    plot_sweep,
    seed_table,
    spread,
    stage_times,
)
from ddpguide.bench.progress import tracked
from ddpguide.bench.report import MALLOC_ENV, Report, check_report_file
from ddpguide.core.commands import InputError, OneLineParser, check_output_file, integer
from ddpguide.pipeline.stages import SEED_SPLIT, num_microbatches

DEFAULT_PLOT = "bench-results/pipeline_split_size_tradeoff.png"
MIN_IMAGE_SIZE = 32  # ResNet50 halves the image five times


@dataclass(frozen=True)
class Plan:
    """What one benchmark run measures."""

    image_size: int
    batch: int
    sizes: tuple[int, ...]            # micro-batch sizes for 1F1B at the source's split
    gpipe_sizes: tuple[int, ...]      # ... for GPipe at the source's split
    balanced_sizes: tuple[int, ...]   # ... for 1F1B at the balanced split
    rounds: int = 1
    repeats: int = 2

    @property
    def profile_size(self) -> int:
        """The micro-batch size at which the blocks are timed to balance the stages."""
        return self.balanced_sizes[0]

    def cases(self) -> list[Case]:
        return [*BASELINES,
                *(Case("pipeline", "1f1b", s) for s in self.sizes),
                *(Case("pipeline", "gpipe", s) for s in self.gpipe_sizes),
                *(Case("pipeline", "1f1b", s, BALANCED) for s in self.balanced_sizes)]


#: The source's split sizes at its batch of 120 (every one divides 120, as the library needs).
SEED_SPLIT_SIZES = (1, 3, 5, 8, 10, 12, 20, 40, 60)

# Quick: small images and few cases. Full: the source's sweep (128x128 images, batch 120);
# the balanced cut is profiled at 20 samples, above the CPU's small-batch cliff.
QUICK = Plan(64, 64, (16, 32), (16,), (16, 32), rounds=1, repeats=2)
FULL = Plan(128, 120, SEED_SPLIT_SIZES, (20,), (20, 40), rounds=2, repeats=3)


def make_plan(quick: bool, image_size: int | None = None, batch_size: int | None = None) -> Plan:
    """The quick or full plan; another batch size sweeps its own divisors from 8 up."""
    plan = QUICK if quick else FULL
    image_size = image_size or plan.image_size
    batch = batch_size or plan.batch
    if batch == plan.batch:
        return dataclasses.replace(plan, image_size=image_size)
    divisors = [d for d in range(8, batch) if batch % d == 0]
    if not divisors:
        raise ValueError(f"batch {batch} has no micro-batch size of 8 or more that divides it")
    sizes = tuple(divisors[-6:])
    main = tuple(d for d in sizes if d >= 16)[:2] or sizes[-1:]
    return dataclasses.replace(plan, image_size=image_size, batch=batch, sizes=sizes,
                               gpipe_sizes=main[:1], balanced_sizes=main)


def run(quick: bool = False, image_size: int | None = None, batch_size: int | None = None,
        channels_last: bool = True, plot_path: str | None = DEFAULT_PLOT) -> Report:
    """Measure every case (see the module docstring) and return the report."""
    plan = make_plan(quick, image_size, batch_size)
    load_before = os.getloadavg()[0]
    cases = plan.cases()
    report = Report("pipeline")
    with tracked(report, total=1 + plan.rounds * len(cases)):  # rank 0 of the worker ticks
        res = measure(cases, plan.batch, plan.image_size, plan.rounds, plan.repeats,
                      plan.profile_size, channels_last, env=None if quick else MALLOC_ENV)
    balanced, names, blocks = res["balanced"], res["block_names"], res["block_times"]
    t = {c.kind: res["seconds"][c] for c in BASELINES}
    rows = pipeline_rows(res)
    ranges = {c.kind: (min(res["samples"][c]), max(res["samples"][c])) for c in BASELINES}

    case = (f"ResNet50 {plan.image_size}x{plan.image_size}, batch {plan.batch}, "
            f"{'channels-last' if channels_last else 'contiguous'}, SGD")
    single = t["single"]
    for c in BASELINES:
        report.add(c.name(balanced), t[c.kind] * 1e3, "ms/step", case=case, kind=c.kind,
                   **spread(res["samples"][c]))
    for r in rows:
        m = num_microbatches(plan.batch, r["split_size"])
        report.add(f"pipeline 2x1 {r['schedule']}, stage 1 from {r['split_point']}, micro-batch "
                   f"{r['split_size']} (m={m})", r["seconds"] * 1e3, "ms/step", case=case, **r,
                   microbatches=m)
    seed_cut = names.index(SEED_SPLIT)
    for label, cut in (("source's split", seed_cut), ("balanced split", names.index(balanced))):
        for stage, seconds in enumerate(stage_times(blocks, cut)):
            report.add(f"{label} (stage 1 from {names[cut]}): stage {stage} time per micro-batch "
                       f"of {plan.profile_size}", seconds * 1e3, "ms cpu")

    best_seed = min((r for r in rows if r["split_point"] == SEED_SPLIT), key=lambda r: r["seconds"])
    best_bal = min((r for r in rows if r["split_point"] == balanced), key=lambda r: r["seconds"])
    m = num_microbatches(plan.batch, best_seed["split_size"])
    s0, s1 = stage_times(blocks, seed_cut)
    report.ratios["pipeline_speedup"] = single / best_seed["seconds"]
    report.ratios["pipeline_speedup_balanced"] = single / best_bal["seconds"]
    report.ratios["model_parallel_over_single"] = t["model_parallel"] / single
    report.ratios["threads2_speedup"] = single / t["threads2"]
    report.ratios["bubble_efficiency"] = single / best_seed["seconds"] / 2
    report.ratios["bubble_bound"] = m / (m + 1)
    report.ratios["stage_balance_bound"] = (s0 + s1) / (2 * max(s0, s1))
    if best_seed["split_size"] == plan.profile_size:  # the stages were timed at this micro-batch size
        report.ratios["stage_work_efficiency"] = m * (s0 + s1) / (2 * best_seed["seconds"])
    report.notes += [
        "speed-ups are time ratios against 1 process x 1 thread; bubble_efficiency is "
        "pipeline_speedup / 2 (work per core) at the best run at the source's split, bubble_bound its "
        "m/(m+p-1) and stage_balance_bound (s0+s1)/(2 max(s0, s1)) of the source's split; "
        "stage times are CPU time of one thread. bubble_bound holds for the work the pipeline "
        "does, m micro-batches through both stages (stage_work_efficiency, m (s0+s1) / (2 x step), "
        "when the stages were timed at the run's micro-batch size); bubble_efficiency measures "
        "against one process on the whole batch, which costs more than the micro-batches' sum "
        "when a small batch is cheaper per sample, and can then exceed it",
        f"balanced split: stage 1 from {balanced}"
        + (" (the source's own cut is already the most balanced)" if balanced == SEED_SPLIT else ""),
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
        "cores: other programs running distort the ratios (two processes get a larger share)",
        "",
        *seed_table(single, t["model_parallel"], best_seed, best_bal),
    ]
    from ddpguide.bench import pipeline_schedules

    pipeline_schedules.add_to(report, quick)  # chapter 13's schedules (alone: that suite)
    if plot_path:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4))
        plot_sweep(rows, t, case, plot_path, ax=fig.add_subplot(), baseline_ranges=ranges)
        report.notes.append(f"split-size trade-off plot: {plot_path} (written by the run, not kept)")
    return report


def check_plot_file(path: str) -> None:
    """``--plot``: a writable file whose extension matplotlib can save."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_output_file(path, "--plot")
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise InputError("--plot", f"{path}: unknown image format {suffix!r} "
                                   "(use .png, .pdf or .svg)")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ddpguide.bench.pipeline",
                           description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--image-size", type=integer(MIN_IMAGE_SIZE), default=None,
                        help="default 64 (quick) or 128 (full, the source's); 224 for full-size images")
    parser.add_argument("--batch", type=integer(1), default=None,
                        help="samples per step; needs a micro-batch size of 8 or more dividing it")
    parser.add_argument("--contiguous", action="store_true", help="NCHW instead of channels-last")
    parser.add_argument("--plot", default=DEFAULT_PLOT,
                        help=f"the split-size plot (default {DEFAULT_PLOT}; '' for none)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    try:  # everything before the run: it takes minutes
        try:
            make_plan(args.quick, args.image_size, args.batch)
        except ValueError as exc:
            raise InputError("--batch", str(exc)) from None
        if args.plot:
            check_plot_file(args.plot)
        if args.json is not None:
            plot = [(args.plot, "the plot (--plot)")] if args.plot else None
            check_report_file(args.json, "--json", protected=plot)
    except InputError as exc:
        parser.error(str(exc))
    report = run(args.quick, args.image_size, args.batch, not args.contiguous, args.plot)
    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
