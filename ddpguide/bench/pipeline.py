"""``python -m ddpguide.bench pipeline``: model and pipeline parallelism on this machine.

One run of two processes (one thread each, the same allocator settings) measures
side by side, ResNet50 with random weights, channels-last, SGD:

* one process with one thread running the whole model (the baseline);
* the seed's naive model parallelism, both halves on the CPU, one thread;
* the 2-process pipeline (gloo, one stage per process) at the seed's split,
  1F1B and GPipe, over a sweep of micro-batch sizes;
* the same with the split point that balances the two stages' measured times;
* one process with two threads (what the two cores give without pipelining).

The one-process cases run on rank 0 while rank 1 waits; all cases run in
interleaved rounds. The full run reproduces the seed's experiment (128x128
images, batch 120); ``--quick`` uses 64x64 images and batch 64.
``python -m ddpguide.bench.pipeline --image-size 224`` runs at full size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..launch import spawn
from ..model_parallel import ModelParallelResNet50, default_devices, load_resnet_weights
from ..pipeline import (SEED_SPLIT, balanced_split, batch_loss, build_resnet50, build_schedule,
                        library_step, model_blocks, num_microbatches, split_model)
from ..runtime import DistEnv, select_runtime
from .report import MALLOC_ENV, Report

NUM_CLASSES = 1000
DEFAULT_PLOT = "bench-results/pipeline_split_size_tradeoff.png"
# The seed article's figures: ResNet50, 128x128 images, batch 120, two GPUs.
SEED_SECONDS = {"single": 3.75, "model_parallel": 4.02, "pipeline_split20": 2.51, "pipeline_split12": 2.43}


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        return x.contiguous(memory_format=memory_format)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.contiguous(), None


class Relayout(nn.Module):
    """Convert the activation to ``memory_format``; hand back a plain contiguous gradient.

    gloo sends and receives only contiguous (NCHW-ordered) tensors, while
    channels-last convolutions are faster on CPUs: a stage converts at its edges.
    """

    def __init__(self, memory_format: torch.memory_format) -> None:
        super().__init__()
        self.memory_format = memory_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Relayout.apply(x, self.memory_format)


def channels_last_stages(stages: Sequence[nn.Module]) -> list[nn.Sequential]:
    """Stages that compute in channels-last but send and receive contiguous tensors."""
    wrapped = []
    for i, stage in enumerate(stages):
        parts = [stage.to(memory_format=torch.channels_last)]
        if i > 0:
            parts.insert(0, Relayout(torch.channels_last))
        if i < len(stages) - 1:
            parts.append(Relayout(torch.contiguous_format))
        wrapped.append(nn.Sequential(*parts))
    return wrapped


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work before reading a clock (CPU ops are already done).
    Every GPU, since a model-parallel step spans two."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def time_blocks(model: nn.Module, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward plus backward of each block of :func:`model_blocks`
    at the batch size of ``x`` (one warm-up round first): what :func:`balanced_split` needs.

    On the CPU this is the thread's CPU time, which other programs competing for the
    cores do not inflate (run it with one thread); on a GPU, synchronised wall time.
    """
    clock = time.thread_time if x.device.type == "cpu" else time.perf_counter

    blocks = [b for _, b in model_blocks(model)]
    samples: list[list[float]] = [[] for _ in blocks]
    for round_ in range(repeats + 1):
        saved, out = [], x
        for j, block in enumerate(blocks):
            # Cut the graph between blocks so each backward can be timed alone.
            inp = out.detach().requires_grad_(j > 0)
            synchronize(x.device)
            start = clock()
            out = block(inp)
            synchronize(x.device)
            saved.append((inp, out, clock() - start))
        grad = torch.ones_like(out)
        for j in reversed(range(len(blocks))):
            inp, out, forward_s = saved[j]
            start = clock()
            out.backward(grad)
            synchronize(x.device)
            if round_:
                samples[j].append(forward_s + clock() - start)
            grad = inp.grad
    model.zero_grad(set_to_none=True)
    return [statistics.median(s) for s in samples]


def make_batch(batch: int, image_size: int, channels_last: bool, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, image_size, image_size, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.to(device), torch.randint(0, NUM_CLASSES, (batch,), generator=gen).to(device)


def _prepare(model: torch.nn.Module, channels_last: bool) -> torch.nn.Module:
    return model.to(memory_format=torch.channels_last) if channels_last else model


def step_time(model, x, y, repeats: int, device: torch.device) -> float:
    """Median seconds of one SGD training step of ``model`` on the full batch (after one warm-up)."""
    step = _whole_model_step(model, x, y)
    samples = []
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if i:  # the first step warms up allocator and kernels
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _whole_model_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = batch_loss(x.shape[0])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss_fn(out, y.to(out.device)).backward()  # a split model answers on its last device
        opt.step()
    return step


@dataclass(frozen=True)
class Case:
    """One measured case. ``kind``: ``single``, ``threads2`` or ``model_parallel`` (rank 0
    alone, the other rank idle) or ``pipeline`` (both ranks). ``split_point`` may be
    :data:`BALANCED`, resolved from the block times measured in the same run."""

    kind: str
    schedule: str = ""
    split_size: int = 0
    split_point: str = SEED_SPLIT

    def name(self, balanced: str) -> str:
        labels = {"single": "1 process x 1 thread, whole model",
                  "threads2": "1 process x 2 threads, whole model",
                  "model_parallel": "naive model parallel (2 halves), 1 thread"}
        if self.kind in labels:
            return labels[self.kind]
        point = balanced if self.split_point == BALANCED else self.split_point
        return f"pipeline 2x1 {self.schedule}, stage 1 from {point}, micro-batch {self.split_size}"


BALANCED = "balanced"
BASELINES = (Case("single"), Case("model_parallel"), Case("threads2"))


def _runner(case: Case, model, rank: int, x, y, balanced: str, channels_last: bool, device):
    """A no-argument training step for ``case`` on this rank (a no-op where the rank idles)."""
    if case.kind != "pipeline":
        if rank != 0:
            return lambda: None
        if case.kind == "model_parallel":
            split = ModelParallelResNet50(devices=default_devices(2), num_classes=NUM_CLASSES)
            load_resnet_weights(split, model.state_dict())
            model = _prepare(split, channels_last)
        step = _whole_model_step(model, x, y)
        if case.kind != "threads2":
            return step

        def two_threads() -> None:
            torch.set_num_threads(2)
            try:
                step()
            finally:
                torch.set_num_threads(1)
        return two_threads
    point = balanced if case.split_point == BALANCED else case.split_point
    stages = split_model(model, [point])
    stage = (channels_last_stages(stages) if channels_last else stages)[rank].to(device)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    batch = x.shape[0]
    schedule = build_schedule(case.schedule, stage, num_microbatches(batch, case.split_size),
                              batch_loss(batch), device)

    def pipeline_step() -> None:
        opt.zero_grad(set_to_none=True)
        library_step(schedule, x, y, case.split_size)
        opt.step()
    return pipeline_step


def bench_worker(cases: list[Case], batch: int, image_size: int, rounds: int, repeats: int,
                 profile_size: int, channels_last: bool = True) -> dict:
    """Every rank of 2 (one thread each): time the blocks (rank 0), pick the balanced split,
    then run all cases in ``rounds`` interleaved rounds of ``repeats`` steps each (plus one
    warm-up step the first time), so a burst of load from elsewhere hits every case alike.
    Returns this rank's seconds per step, per case and round."""
    env = DistEnv.from_environ()
    device = select_runtime(env.local_world_size, backend=dist.get_backend()).device(env.local_rank)
    model = _prepare(build_resnet50(0, NUM_CLASSES), channels_last).to(device)
    x, y = make_batch(batch, image_size, channels_last, device)
    names = [name for name, _ in model_blocks(model)]
    profile = [None, None]
    if env.rank == 0:
        blocks = time_blocks(model, x[:profile_size], repeats=max(2, repeats))
        profile = [blocks, balanced_split_point(blocks, names)]
    dist.broadcast_object_list(profile, src=0)
    blocks, balanced = profile
    # A balanced case that resolves to the seed's cut is not measured twice.
    first_of: dict[str, int] = {}
    same_as = [first_of.setdefault(c.name(balanced), i) for i, c in enumerate(cases)]
    runners = [_runner(c, model, env.rank, x, y, balanced, channels_last, device)
               if same_as[i] == i else None for i, c in enumerate(cases)]
    times = [[[] for _ in range(rounds)] for _ in cases]
    for r in range(rounds):
        for c, step in enumerate(runners):
            if step is None:
                times[c] = times[same_as[c]]
                continue
            for i in range(repeats + (r == 0)):
                dist.barrier()
                start = time.perf_counter()
                step()
                synchronize(device)
                if r or i:
                    times[c][r].append(time.perf_counter() - start)
    return {"times": times, "block_times": blocks, "block_names": names, "balanced": balanced}


def measure(cases: list[Case], batch: int, image_size: int, rounds: int = 1, repeats: int = 2,
            profile_size: int = 16, channels_last: bool = True) -> dict:
    """Run :func:`bench_worker` on 2 processes x 1 thread with :data:`MALLOC_ENV`.

    Returns ``seconds``, a dict from case to seconds per step (a step lasts as long
    as its slower rank; the median per round, then the best round), the block
    times and names, and the balanced split point.
    """
    per_rank = spawn(bench_worker, 2, cases, batch, image_size, rounds, repeats, profile_size,
                     channels_last, threads_per_rank=1, env=MALLOC_ENV, echo=False,
                     timeout=3600, collective_timeout=900)
    seconds = {
        case: min(statistics.median(max(ts) for ts in zip(*(r["times"][c][k] for r in per_rank)))
                  for k in range(rounds))
        for c, case in enumerate(cases)
    }
    rank0 = per_rank[0]
    return {"seconds": seconds, "block_times": rank0["block_times"],
            "block_names": rank0["block_names"], "balanced": rank0["balanced"]}


def count_slow_conv2d(model: torch.nn.Module, x: torch.Tensor) -> int:
    """How many convolutions of one forward pass ATen sends to its native
    ``_slow_conv2d`` kernel instead of oneDNN (the small-batch, one-thread cliff)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_slow_conv2d_forward")


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side logs start/stop lines straight to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def pipeline_rows(measured: dict) -> list[dict]:
    """The pipeline cases of :func:`measure` as rows (schedule, split_size, split_point,
    seconds), the balanced split resolved and duplicates of the seed's cut dropped."""
    rows = {}
    for case, seconds in measured["seconds"].items():
        if case.kind == "pipeline":
            point = measured["balanced"] if case.split_point == BALANCED else case.split_point
            rows[(case.schedule, case.split_size, point)] = {
                "schedule": case.schedule, "split_size": case.split_size, "split_point": point,
                "seconds": seconds}
    return list(rows.values())


def balanced_split_point(block_times: list[float], names: list[str]) -> str:
    """The first block of stage 1 that best balances two stages (may be the seed's own cut)."""
    return names[balanced_split(block_times, 2)[0]]


def stage_times(block_times: list[float], cut: int) -> tuple[float, float]:
    """Seconds of the two stages when the second starts at block ``cut``."""
    return sum(block_times[:cut]), sum(block_times[cut:])


def plot_sweep(rows: list[dict], baselines: dict, title: str, path: str | None = None, ax=None):
    """Seconds per step against micro-batch size, one line per (schedule, split point),
    with the one-process cases as horizontal lines; saved to ``path`` when given.
    Draws on ``ax`` (a new pyplot figure by default) and returns the figure."""
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(7, 4))
    fig = ax.figure
    for key in sorted({(r["schedule"], r["split_point"]) for r in rows}):
        pts = sorted((r["split_size"], r["seconds"])
                     for r in rows if (r["schedule"], r["split_point"]) == key)
        ax.plot(*zip(*pts), "o-", label=f"pipeline {key[0]}, stage 1 from {key[1]}")
    styles = {"single": ("1 process x 1 thread", "k"),
              "model_parallel": ("naive model parallel", "tab:red"),
              "threads2": ("1 process x 2 threads", "tab:gray")}
    for name, (label, color) in styles.items():
        if name in baselines:
            ax.axhline(baselines[name], ls="--", color=color, label=label)
    if "single" in baselines:
        ax.axhline(baselines["single"] / 2, ls=":", color="k", label="2 cores, perfectly used")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["split_size"] for r in rows})
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("micro-batch size (split_size)")
    ax.set_ylabel("seconds per training step")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


@dataclass(frozen=True)
class Plan:
    """What one benchmark run measures."""

    image_size: int
    batch: int
    sizes: tuple[int, ...]            # micro-batch sizes for 1F1B at the seed's split
    gpipe_sizes: tuple[int, ...]      # ... for GPipe at the seed's split
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


# Quick: small images, under a minute. Full: the seed's experiment (128x128 images,
# batch 120) with split sizes that divide the batch; 12 shows the small-batch cliff.
QUICK = Plan(64, 64, (16, 32), (16,), (16, 32), rounds=1, repeats=2)
FULL = Plan(128, 120, (12, 20, 30, 60), (20,), (20, 30), rounds=2, repeats=2)


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
    res = measure(cases, plan.batch, plan.image_size, plan.rounds, plan.repeats, plan.profile_size,
                  channels_last)
    balanced, names, blocks = res["balanced"], res["block_names"], res["block_times"]
    t = {c.kind: res["seconds"][c] for c in BASELINES}
    rows = pipeline_rows(res)

    report = Report("pipeline")
    case = (f"ResNet50 {plan.image_size}x{plan.image_size}, batch {plan.batch}, "
            f"{'channels-last' if channels_last else 'contiguous'}, SGD")
    single = t["single"]
    for c in BASELINES:
        report.add(c.name(balanced), t[c.kind] * 1e3, "ms/step", case=case)
    for r in rows:
        m = num_microbatches(plan.batch, r["split_size"])
        report.add(f"pipeline 2x1 {r['schedule']}, stage 1 from {r['split_point']}, micro-batch "
                   f"{r['split_size']} (m={m})", r["seconds"] * 1e3, "ms/step", case=case, **r,
                   microbatches=m)
    seed_cut = names.index(SEED_SPLIT)
    for label, cut in (("seed split", seed_cut), ("balanced split", names.index(balanced))):
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
    report.notes += [
        "speed-ups are time ratios against 1 process x 1 thread; bubble_efficiency is "
        "pipeline_speedup / 2 (work per core) at the best seed-split run, bubble_bound its "
        "m/(m+p-1) and stage_balance_bound (s0+s1)/(2 max(s0, s1)) of the seed split; "
        "stage times are CPU time of one thread",
        f"balanced split: stage 1 from {balanced}"
        + (" (the seed's own cut is already the most balanced)" if balanced == SEED_SPLIT else ""),
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
        "cores: other programs running distort the ratios (two processes get a larger share)",
        "",
        *seed_table(single, t["model_parallel"], best_seed, best_bal),
    ]
    if plot_path:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4))
        plot_sweep(rows, t, case, plot_path, ax=fig.add_subplot())
        report.notes.append(f"split-size trade-off plot: {Path(plot_path).resolve()}")
    return report


def seed_table(single: float, model_parallel: float, best_seed: dict, best_balanced: dict) -> list[str]:
    """The seed's comparison, its GPU seconds next to this machine's milliseconds."""
    s = SEED_SECONDS
    rows = [
        ("one device", f"{s['single']:.2f} s", f"{single * 1e3:.0f} ms (1 process x 1 thread)"),
        ("model parallel", f"{s['model_parallel']:.2f} s ({s['model_parallel'] / s['single']:.2f}x time)",
         f"{model_parallel * 1e3:.0f} ms ({model_parallel / single:.2f}x time)"),
        ("pipelined", f"{s['pipeline_split20']:.2f} s ({s['single'] / s['pipeline_split20']:.2f}x, split 20)",
         f"{best_seed['seconds'] * 1e3:.0f} ms ({single / best_seed['seconds']:.2f}x, seed split, "
         f"micro-batch {best_seed['split_size']})"),
        ("pipelined, best",
         f"{s['pipeline_split12']:.2f} s ({s['single'] / s['pipeline_split12']:.2f}x, split 12)",
         f"{best_balanced['seconds'] * 1e3:.0f} ms ({single / best_balanced['seconds']:.2f}x, stage 1 "
         f"from {best_balanced['split_point']}, micro-batch {best_balanced['split_size']})"),
    ]
    lines = [f"{'':16}  {'seed: 2 GPUs, 128x128, batch 120':34}  this machine: CPU processes"]
    lines += [f"{name:16}  {gpu:34}  {cpu}" for name, gpu, cpu in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpguide.bench.pipeline",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--image-size", type=int, default=None,
                        help="default 64 (quick) or 128 (full, the seed's); 224 for full-size images")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--contiguous", action="store_true", help="NCHW instead of channels-last")
    parser.add_argument("--plot", default=DEFAULT_PLOT)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    report = run(args.quick, args.image_size, args.batch, not args.contiguous, args.plot)
    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
