"""The planner checked on this machine, and against published GPU runs (chapter 16).

``python -m ddpguide.bench plan [--quick] [--json FILE]``

* the hardware's inputs, measured first and only by microbenchmarks: ``plan_cost.py
  --measure`` (matmul FLOP/s per shape on one thread, memory bandwidth, one small
  operation) and ``plan_cost.py --sweep`` on 4 ranks (gloo all-reduce: alpha, beta);
* time, 4 ranks on this machine's loopback (a stand-in for chapter 15's two emulated
  nodes): every layout ``train.py`` runs of the GPT (float32, dim 256, 2 layers, sequence
  64, batch 8), predicted then measured: ``step_predicted_over_measured`` per layout,
  ``rank_correlation`` (Spearman), ``best_layout_measured_over_best_measured``, and the same
  ranking with DTensor's built-in link constants (``rank_correlation_dtensor_constants``);
* memory: the same runs, and at 8 ranks every layout of the checks' GPT (float64): the
  parts ``train.py --cost`` counts (parameters, gradients, AdamW state, what autograd
  saves) predicted over counted at the busiest rank, ``memory_predicted_over_measured``;
* ``DDPGUIDE_PLAN_CACHE=DIR`` keeps each finished run of train.py in DIR and reads it back
  in a later run (an interrupted benchmark resumes; the predictions are made again);
* published: torchtitan's Llama 3.1 H100 rows predicted (GPU, model only),
  ``published_predicted_over_reported`` per row.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from ddpguide.bench.report import Report
from ddpguide.plan import catalog, checks, measure, published, search

TIME_MODEL = dict(layers=2, dim=256, heads=4, ffn=1024)
TIME_SEQ, TIME_BATCH = 64, 8
CHECK_SEQ, CHECK_BATCH = 16, 8


def _say(line: str) -> None:
    print(line, flush=True)


def _plain(p, model, world, batch, seq):
    """The layouts train.py runs with its defaults: 1F1B, micro-batches 2 x pp, no checkpointing."""
    return [lay for lay in search.layouts(p, model, world, batch, seq, runnable=True, microbatch_choices=1)
            if lay.ac == "none" and lay.schedule == "1F1B"]


def run(quick: bool = False) -> Report:
    from tqdm.auto import tqdm

    report = Report("plan")
    cache = os.environ.get("DDPGUIDE_PLAN_CACHE")  # a folder: runs kept, an interrupted run resumed
    p = search.program()
    hw = measure.hardware(p, "this-machine", ranks=4)
    hw.gpus_per_node = 4
    report.add("this machine: best matmul", hw.peak / 1e9, "GFLOP/s a thread", shapes=len(hw.matmul))
    report.add("gloo alpha", hw.links["node"][0] * 1e6, "us", beta_gb_s=1 / hw.links["node"][1] / 1e9,
               per_call_us=hw.collective_seconds * 1e6, op_us=hw.op_seconds * 1e6)
    _say(f"hardware: matmul up to {hw.peak / 1e9:.1f} GFLOP/s, alpha {hw.links['node'][0] * 1e6:.0f} us, "
         f"{1 / hw.links['node'][1] / 1e9:.2f} GB/s, one op {hw.op_seconds * 1e6:.1f} us")
    dt_hw = checks.dtensor_hardware(hw)
    model = catalog.model(p, "gpt", **TIME_MODEL)
    pol = catalog.policy(p, "float32")
    layouts = _plain(p, model, 4, TIME_BATCH, TIME_SEQ)
    if quick:
        layouts = [lay for lay in layouts if search.name(lay) in ("FSDP 4", "PP x FSDP 2 x 2, 1F1B m2")]
    checked = [] if quick else _plain(p, catalog.model(p, "gpt-check"), 8, CHECK_BATCH, CHECK_SEQ)
    bar = tqdm(total=len(layouts) + len(checked), desc="plan", file=sys.stderr, leave=False)
    predicted, dtensor, measured, memory = [], [], [], {}
    for lay in layouts:
        name = search.name(lay)
        result = measure.run_layout(lay, model, TIME_SEQ, TIME_BATCH, "float32", steps=4 if quick else 6,
                                    cache=cache)
        bar.update()
        step = p.step(model, lay, pol, hw, TIME_BATCH, TIME_SEQ)
        predicted.append(step["total"])
        dtensor.append(p.step(model, lay, pol, dt_hw, TIME_BATCH, TIME_SEQ)["total"])
        measured.append(result["step_seconds"])
        mem = measure.memory_ratios(p, lay, model, pol, TIME_SEQ, TIME_BATCH, result)
        memory[f"4 ranks: {name}"] = mem["peak"]
        report.ratios[f"step_predicted_over_measured: {name}"] = step["total"] / result["step_seconds"]
        report.ratios[f"memory_predicted_over_measured: 4 ranks: {name}"] = mem["peak"]
        report.add(f"{name}: step", result["step_seconds"] * 1e3, "ms", predicted_ms=step["total"] * 1e3,
                   parts_ms={k: v * 1e3 for k, v in step.items()}, dtensor_constants_ms=dtensor[-1] * 1e3,
                   memory_predicted=mem["predicted"], memory_counted=mem["measured"])
        _say(f"{name}: step predicted {step['total'] * 1e3:.1f} ms, measured "
             f"{result['step_seconds'] * 1e3:.1f} ms ({step['total'] / result['step_seconds']:.2f}); "
             f"memory {mem['peak']:.3f}")
    report.ratios["rank_correlation"] = checks.spearman(predicted, measured)
    report.ratios["rank_correlation_dtensor_constants"] = checks.spearman(dtensor, measured)
    report.ratios["best_layout_measured_over_best_measured"] = checks.choice(predicted, measured)
    report.ratios["best_layout_measured_over_best_measured_dtensor_constants"] = checks.choice(dtensor, measured)
    ratios = [a / b for a, b in zip(predicted, measured)]
    report.add("step predicted over measured, all layouts", statistics.median(ratios), "median",
               min=min(ratios), max=max(ratios), dtensor_constants_median=statistics.median(
                   a / b for a, b in zip(dtensor, measured)))
    check_model, check_pol = catalog.model(p, "gpt-check"), catalog.policy(p, "float64")
    for lay in checked:
        name = search.name(lay)
        result = measure.run_layout(lay, check_model, CHECK_SEQ, CHECK_BATCH, "float64", steps=2, cache=cache)
        bar.update()
        mem = measure.memory_ratios(p, lay, check_model, check_pol, CHECK_SEQ, CHECK_BATCH, result)
        memory[f"8 ranks: {name}"] = mem["peak"]
        report.ratios[f"memory_predicted_over_measured: 8 ranks: {name}"] = mem["peak"]
        _say(f"8 ranks, {name}: memory predicted / counted {mem['peak']:.4f}")
    bar.close()
    report.add("memory predicted over measured, all layouts", statistics.median(memory.values()), "median",
               min=min(memory.values()), max=max(memory.values()), layouts=len(memory))
    rows = published.compare(p)
    for row in rows:
        key = f"published_predicted_over_reported: {row['source']}, {row['model']}, {row['technique']}"
        report.ratios[key] = row["ratio"]
    summary = published.summary(rows)
    report.add("published predicted over reported", summary["median"], "median", **summary, source=published.SOURCE,
               rows=rows)
    report.notes.append(f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on this machine's "
                        "2 cores shared with other work: 4 ranks of 1 thread each on 2 cores, gloo on loopback "
                        "(a stand-in for chapter 15's emulated nodes)")
    report.notes.append("no prediction uses a run of the layout it predicts: the inputs are the "
                        "microbenchmarks above and the model's shapes")
    return report
