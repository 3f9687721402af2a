"""The GPT of chapter 14 on several layouts: cost predicted, then counted and timed.

``python -m ddpguide.bench gpt [--quick] [--json FILE]``

Every case runs ``book/programs/gpt/train.py --cost`` (float32, a width where matmuls
dominate, 1 thread a rank):

* ``mfu_one_process``: the step's model FLOPs (6 x parameters x tokens + attention) per
  second in one process, over the matmul peak that process measured in the same run (the
  best of a burst before the first step and one after the last);
* gloo's latency-bandwidth model, fitted to timed all-reduces on 2 and 4 ranks
  (:func:`ddpguide.bench.allreduce.measure`), and each layout's step time predicted
  over the measured step, ``step_time_predicted_over_measured_<layout>``: the same
  layout's step measured on a model 16 times narrower (``--dim 16``) holds what does
  not grow with the width (the work per operation of DTensor, FSDP2 and the schedule,
  and the latency of every message); what grows is predicted (compute at the FLOPs
  efficiency of one process on one rank's share of the batch, times ranks / cores when
  ranks share cores, plus beta x the bytes on the wire of the counted calls) and the
  difference from the narrow model added (:func:`ddpguide.gpt.cost.predict_from_narrow`).
  The plain alpha-beta prediction (compute plus every message's alpha and beta) is in
  each layout's details;
* ``bytes_counted_over_predicted``: every kind's counted bytes over the prediction,
  all layouts together (and the worst kind of any layout in the details);
* ``activation_checkpoint_peak_over_plain``: the growth of the process's peak resident
  memory over a training run (ru_maxrss less the resident size before the first step),
  with ``--checkpoint-activations`` over without, one process, a batch whose
  activations dwarf the weights;
* ``compile_step_over_eager``: median step with ``--compile`` over eager (the first
  step, which compiles, left out; its time is in the details).
"""

from __future__ import annotations

import os
import re
import sys

from ddpguide.bench.allreduce import measure as time_all_reduce
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.gpt import cost
from ddpguide.launch.spawn import spawn

MODEL = ("--dtype", "float32", "--dim", "256", "--heads", "4", "--layers", "2", "--seq", "64",
         "--batch", "8", "--clip", "1.0")
LAYOUTS = (("1 process", 1, ()), ("FSDP2 2", 2, ("--dp-shard", "2")), ("TP 2", 2, ("--tp", "2")),
           ("PP 2", 2, ("--pp", "2")))
MORE = (("DDP 2", 2, ("--dp-replicate", "2")), ("CP 2", 2, ("--cp", "2")),
        ("FSDP x TP 2 x 2", 4, ("--dp-shard", "2", "--tp", "2")),
        ("PP x FSDP 2 x 2", 4, ("--pp", "2", "--dp-shard", "2")))
#: the narrow model whose step holds what does not grow with the width
NARROW = ("--dim", "16")
KIB = 2**10


def _say(line: str) -> None:
    print(line, flush=True)


def _key(name: str) -> str:
    """``"FSDP x TP 2 x 2"`` -> ``"fsdp_x_tp_2_x_2"``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def fit(quick: bool) -> tuple[tuple[float, float], list]:
    """Alpha and beta of gloo's all-reduce on this machine (2 and 4 ranks); ``quick`` keeps
    glibc's own allocator settings, so that warm ranks may run it."""
    sizes = [4 * KIB, 64 * KIB, 1024 * KIB] if quick else [4 * KIB * 4**k for k in range(7)]
    samples = []
    for ranks in (2, 4):
        times = spawn(time_all_reduce, ranks, sizes, 3 if quick else 10, ("gloo",),
                      env=None if quick else MALLOC_ENV, echo=False, timeout=600)[0]
        samples += [("all_reduce", ranks, size, times[size]["gloo"]) for size in sizes]
    return cost.fit_alpha_beta(samples), samples


def _run(options, ranks, steps, extra=(), malloc=True):
    """One launch of ``train.py --cost``; ``malloc``: with :data:`MALLOC_ENV` (freed blocks kept,
    which a fresh interpreter reads, so the ranks are never forked from a warm server)."""
    env = {**(MALLOC_ENV if malloc else {}), "OMP_NUM_THREADS": "1"}
    result, _ = cost.measure(options, ranks, extra=(*MODEL, "--steps", str(steps), *extra),
                             timeout=900, env=env)
    return result


def run(quick: bool = False) -> Report:
    """Measure everything of the module docstring and return the report."""
    from tqdm.auto import tqdm

    report = Report("gpt")
    steps = 5 if quick else 12
    # --quick checks that every figure comes out: its step runs keep glibc's own settings (the
    # memory pair below keeps MALLOC_ENV's), so that warm ranks may run them
    malloc = not quick
    layouts = LAYOUTS if quick else LAYOUTS + MORE
    details = {"model": " ".join(MODEL), "steps": steps, "threads per rank": 1}
    progress = tqdm(total=len(layouts) + 5 + (0 if quick else 1), desc="gpt", file=sys.stderr, leave=False)
    (alpha, beta), samples = fit(quick)
    progress.update()
    report.add("gloo latency (alpha)", alpha * 1e6, "us", samples=samples)
    report.add("gloo inverse bandwidth (beta)", 1 / beta / 1e9 if beta > 0 else float("inf"), "GB/s")
    _say(f"gloo alpha-beta: {alpha * 1e6:.1f} us a message, {1 / beta / 1e9:.2f} GB/s")
    results, narrow = {}, {}
    for name, ranks, options in layouts:
        results[name] = _run(options, ranks, steps, malloc=malloc)
        if ranks > 1:
            narrow[name] = _run(options, ranks, steps, NARROW, malloc=malloc)
        progress.update()
        _say(f"{name}: step {results[name]['step_seconds'] * 1e3:.1f} ms, "
             f"MFU {results[name]['mfu']:.3f}"
             + (f"; at --dim 16 {narrow[name]['step_seconds'] * 1e3:.1f} ms" if name in narrow else ""))
    single = results["1 process"]
    report.ratios["mfu_one_process"] = single["mfu"]
    efficiency = {1: single["mfu"]}  # ranks -> MFU of one process doing one rank's share
    for ranks in sorted({r for _, r, _ in layouts} - {1}):
        batch = int(MODEL[MODEL.index("--batch") + 1]) // ranks
        efficiency[ranks] = _run((), 1, steps, ("--batch", str(batch)), malloc=malloc)["mfu"]
        _say(f"1 process, batch {batch} (one rank's share of {ranks}): MFU {efficiency[ranks]:.3f}")
        progress.update()
    report.add("1 process: matmul peak", single["peak_flops"] / 1e9, "GFLOP/s", **details)
    counted = predicted = 0
    worst = 1.0
    for name, result in results.items():
        found = cost.compare(result)
        for v in found["bytes"].values():
            counted, predicted = counted + v["counted"], predicted + v["predicted"]
            if abs(v["ratio"] - 1) > abs(worst - 1):
                worst = v["ratio"]
        extra = {}
        if name != "1 process":
            stages = result["layout"]["pp"]
            ranks = len(result["memory"])
            step = cost.predict_from_narrow(result, narrow[name], beta, efficiency[ranks], stages,
                                            os.cpu_count())
            ratio = step / result["step_seconds"]
            extra = {"predicted_ms": step * 1e3, "narrow_step_ms": narrow[name]["step_seconds"] * 1e3,
                     "alpha_beta_predicted_over_measured": cost.predict_step_seconds(
                         result, (alpha, beta), efficiency[ranks], stages) / result["step_seconds"]}
            report.ratios[f"step_time_predicted_over_measured_{_key(name)}"] = ratio
            _say(f"{name}: predicted / measured step {ratio:.3f} (alpha-beta alone "
                 f"{extra['alpha_beta_predicted_over_measured']:.3f})")
        report.add(f"{name}: step", result["step_seconds"] * 1e3, "ms", bytes=found["bytes"],
                   memory_measured_over_predicted=found["memory"], mfu=result["mfu"], **extra, **details)
    report.ratios["bytes_counted_over_predicted"] = counted / predicted
    report.add("bytes counted over predicted, worst kind of any layout", worst, "")
    _say(f"bytes_counted_over_predicted: {counted / predicted:.4f} (worst kind {worst:.4f})")

    big = ("--batch", "32", "--seq", "128")
    plain = _run((), 1, 3, big)
    progress.update()
    checkpointed = _run((), 1, 3, (*big, "--checkpoint-activations"))
    progress.update()
    ratio = (checkpointed["memory"][0]["peak_rss_growth"] / plain["memory"][0]["peak_rss_growth"])
    report.ratios["activation_checkpoint_peak_over_plain"] = ratio
    report.add("peak resident growth, plain", plain["memory"][0]["peak_rss_growth"] / 2**20, "MiB",
               saved_for_backward=plain["memory"][0]["activations"])
    report.add("peak resident growth, checkpointed",
               checkpointed["memory"][0]["peak_rss_growth"] / 2**20, "MiB")
    _say(f"activation_checkpoint_peak_over_plain: {ratio:.3f}")

    small = ("--layers", "1") if quick else ()  # compiling takes minutes on 2 shared cores
    eager = _run((), 1, steps, small, malloc=malloc)
    progress.update()
    compiled = _run((), 1, steps, (*small, "--compile"), malloc=malloc)
    progress.update()
    progress.close()
    ratio = compiled["step_seconds"] / eager["step_seconds"]
    report.ratios["compile_step_over_eager"] = ratio
    report.add("--compile: first step (compiles)", compiled["first_step_seconds"], "s",
               eager_first_step=eager["first_step_seconds"])
    _say(f"compile_step_over_eager: {ratio:.3f}")
    report.notes.append(
        "step time predicted: the same layout's step measured at --dim 16 (what does not grow with "
        "the width), plus the growth from --dim 16 to the model's width of (model FLOPs / ranks) / "
        "(MFU of one process on one rank's share of the batch x the matmul peak each rank measured "
        "at once) x (m + stages - 1) / m under a pipeline x ranks / cores where ranks share cores, "
        "and of beta x ring bytes of every counted call, for the busiest rank")
    report.notes.append(f"step times: the median over steps 3..{steps} of every rank (the "
                        "first builds AdamW's state, the second runs under the counters)")
    return report
