"""The planner checked on chapter 15's emulated cluster, and against published GPU runs (chapter 16).

``python -m ddpguide.bench plan [--quick] [--json FILE]`` (root, iproute2: the cluster)

* the cluster: 2 nodes x 2 ranks (network namespaces), each node's link limited to ``LINK``
  by ``tc tbf`` (:mod:`ddpguide.cluster`);
* its hardware, measured first and only by microbenchmarks: ``plan_measure.py --measure --ranks
  4`` on the host (matmul FLOP/s per shape on one thread, memory bandwidth, one small
  operation, the cores 4 busy processes get) and ``plan_measure.py --sweep`` across the nodes
  (gloo all-reduce inside a node and across: alpha, beta, burst);
* time: every layout ``train.py`` runs of the GPT (``TIME_MODEL``, float32, sequence 64,
  batch 8), predicted, then run across the nodes with ``torchrun --nnodes 2``:
  ``step_predicted_over_measured`` per layout, ``rank_correlation`` (Spearman),
  ``best_layout_measured_over_best_measured``, and the same ranking with DTensor's built-in
  link constants in place of the measured links (``..._dtensor_constants``);
* the command: the ``torchrun`` lines ``python -m ddpguide.plan`` prints for that GPT on the
  cluster's hardware, run as printed just after the hardware is measured
  (:mod:`ddpguide.bench.plan_command`): ``command_step_predicted_over_measured``,
  ``command_memory_predicted_over_measured``;
* time on loopback (no link limit, so compute is most of some steps): the ``LOOPBACK`` layouts
  of GPTs of several widths, each predicted from ``plan_measure.py --measure`` and ``--sweep``
  run just before it, with as many ranks (``..._loopback_table``), and with the compute rate
  its own ranks got, timed by ``train.py --cost --rate-window`` between its steps
  (:mod:`ddpguide.bench.plan_loopback`, :mod:`ddpguide.plan.calibrate`:
  ``step_predicted_over_measured_loopback``, ``rank_correlation_loopback``); ``python -m
  ddpguide.bench.plan_loopback --add FILE`` measures these again alone, into a saved report;
* each term of the model doubled against the cluster's and loopback's layouts
  (``perturbed_<term>_out_of_band``) and the predicted compute share of all of them
  (``compute_share_min``, ``compute_share_max``);
* memory: the same runs, and on this machine's loopback every layout of the checks' GPT
  (float64) at 8 ranks, and at 4 with grouped-query attention and with a mixture of experts:
  the parts ``train.py --cost`` counts (parameters, gradients, AdamW state, what autograd
  saves) predicted over counted at the busiest rank (under EP, where the routing decides each
  rank's rows, all ranks together), ``memory_predicted_over_measured``;
* ``DDPGUIDE_PLAN_CACHE=DIR`` keeps each finished run of train.py in DIR and reads it back
  in a later run (an interrupted benchmark resumes; the predictions are made again). A time
  run is kept with the table it was measured beside and read back only with it: a loopback
  run with its own table, a cluster run under the fingerprint of the cluster's table (which
  each benchmark measures anew, so the cluster's runs are not reused across benchmarks);
* ``--quick``: the two layouts of ``QUICK`` (one timed step each) and no runs on loopback;
  the microbenchmarks time for less (``QUICK_SECONDS``, ``QUICK_REPEATS``);
* published: torchtitan's Llama 3.1 H100 rows, the Ultra-Scale Playbook's best
  configurations and picotron's two MFU figures, predicted (GPU, model only):
  ``published_predicted_over_reported`` per row.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ddpguide.bench import plan_command
from ddpguide.bench.plan_loopback import loopback_check, scored
from ddpguide.bench.report import Report
from ddpguide.plan import catalog, checks, measure, published, search, tracker
from ddpguide.plan.checks import (
    CHECK_BATCH,
    CHECK_SEQ,
    LINK,
    NODES,
    RANKS_PER_NODE,
    TIME_BATCH,
    TIME_MODEL,
    TIME_SEQ,
    TRACKER,
)

#: the memory check's runs on loopback: (label, ranks, the checks' GPT changed so)
CHECK_SHAPES: tuple[tuple[str, int, dict], ...] = (("8 ranks", 8, {}), ("4 ranks, GQA", 4, {"kv_heads": 2}),
                ("4 ranks, MoE", 4, {"experts": 4, "top_k": 2}))
QUICK = ("PP x FSDP 2 x 2, 1F1B m2", "PP x HSDP 2 x 2, 1F1B m2")  # steps of about 0.5 s (HSDP alone: 3 s)
#: the quick mode's microbenchmarks (``plan_measure.py --seconds``, ``--repeats``): shorter
#: timings, fewer of each size
QUICK_SECONDS, QUICK_REPEATS = 0.02, 3


def _say(line: str) -> None:
    print(line, flush=True)


def time_check(report: Report, p, quick: bool, cache: str | None, bar) -> dict:
    """Every layout of the GPT on the cluster: predicted, then run; the ratios into the report."""
    from ddpguide.cluster import Spec, up

    model, pol = catalog.model(p, "gpt", **TIME_MODEL), catalog.policy(p, "float32")
    layouts = search.plain(p, model, NODES * RANKS_PER_NODE, TIME_BATCH, TIME_SEQ)
    if quick:
        layouts = [lay for lay in layouts if search.name(lay) in QUICK]
    rows = []
    with up(Spec(nodes=NODES, ranks_per_node=RANKS_PER_NODE, link=LINK)) as cluster:
        seconds, repeats = (QUICK_SECONDS, QUICK_REPEATS) if quick else (None, None)  # None: the program's
        hw = measure.cluster_hardware(p, cluster, seconds=seconds, repeats=repeats)
        dt_hw, table = checks.dtensor_hardware(hw), measure.fingerprint(hw)  # runs kept with this table only
        report.add("cluster hardware", hw.peak / 1e9, "GFLOP/s a thread (best matmul)", links=hw.links,
                   cores=hw.cores, op_us=hw.op_seconds * 1e6, bandwidth_gb_s=hw.bandwidth / 1e9,
                   hardware={k: v for k, v in vars(hw).items() if k != "matmul"}, matmul=hw.matmul)
        net = hw.links["net"]
        _say(f"cluster {LINK}: net alpha {net[0] * 1e3:.2f} ms, {1 / net[1] / 1e6:.2f} MB/s, burst "
             f"{net[2] / 1e3:.0f} kB; {hw.cores:.2f} cores for 4 busy ranks")
        with tempfile.TemporaryDirectory(prefix="ddpguide-plan-command-") as folder:  # beside the hardware
            plan_command.measure(report, p, cluster, hw, Path(folder), steps=5 if quick else 20)
        bar.total += len(layouts)
        for lay in layouts:
            name = search.name(lay)
            load = os.getloadavg()[0]
            result = measure.run_on_cluster(cluster, lay, model, TIME_SEQ, TIME_BATCH, "float32",  # quick: one
                                            steps=3 if quick else 5, cache=cache, beside=table)  # timed step
            bar.update()
            step = p.step(model, lay, pol, hw, TIME_BATCH, TIME_SEQ)
            mem = measure.memory_ratios(p, lay, model, pol, TIME_SEQ, TIME_BATCH, result)
            rows.append({"name": name, "layout": lay, "hardware": hw, "predicted": step["total"],
                         "measured": result["step_seconds"],
                         "dtensor": p.step(model, lay, pol, dt_hw, TIME_BATCH, TIME_SEQ)["total"]})
            report.ratios[f"step_predicted_over_measured: {name}"] = step["total"] / result["step_seconds"]
            report.ratios[f"memory_predicted_over_measured: 4 ranks: {name}"] = mem["check"]
            report.add(f"{name}: step", result["step_seconds"] * 1e3, "ms", predicted_ms=step["total"] * 1e3,
                       parts_ms={k: v * 1e3 for k, v in step.items()}, dtensor_constants_ms=rows[-1]["dtensor"] * 1e3,
                       memory_predicted=mem["predicted"], memory_counted=mem["measured"], load_before=load,
                       first_step_ms=result["first_step_seconds"] * 1e3)
            _say(f"{name}: step predicted {step['total'] * 1e3:.0f} ms, measured "
                 f"{result['step_seconds'] * 1e3:.0f} ms ({step['total'] / result['step_seconds']:.2f}); "
                 f"memory {mem['peak']:.3f}; load {load:.1f}")
    predicted, measured = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    dtensor = [r["dtensor"] for r in rows]
    report.ratios["rank_correlation"] = checks.spearman(predicted, measured)
    report.ratios["rank_correlation_dtensor_constants"] = checks.spearman(dtensor, measured)
    report.ratios["best_layout_measured_over_best_measured"] = checks.choice(predicted, measured)
    report.ratios["best_layout_measured_over_best_measured_dtensor_constants"] = checks.choice(dtensor, measured)
    ratios = [a / b for a, b in zip(predicted, measured)]
    report.add("step predicted over measured, all layouts", statistics.median(ratios), "median",
               min=min(ratios), max=max(ratios), within=sum(0.8 <= r <= 1.25 for r in ratios), layouts=len(ratios),
               dtensor_constants_median=statistics.median(a / b for a, b in zip(dtensor, measured)))
    return {r["name"]: r for r in rows}


def tracked(report: Report, p) -> None:
    """The predicted simultaneous peak (``at_peak``: FSDP's gathered and prefetched blocks, DDP's
    buckets, the loss's gradients included) over the peak torch's own tracker (FSDPMemTracker,
    MemTracker) sees at the busiest rank, every layout of the checks' GPT on 4 ranks
    (:func:`tracker.every_layout`: TP's loss under ``loss_parallel``, CP's zig-zag chunks, a
    pipeline's micro-batches under its schedule, as train.py runs them)."""
    for name, ratio in tracker.every_layout(p, CHECK_SEQ, CHECK_BATCH, say=_say).items():
        report.ratios[f"{TRACKER}{name}"] = ratio


def run(quick: bool = False) -> Report:
    from tqdm.auto import tqdm

    report = Report("plan")
    cache = os.environ.get("DDPGUIDE_PLAN_CACHE")  # a folder: runs kept, an interrupted run resumed
    p = search.program()
    checked = [] if quick else [(label, model, lay) for label, ranks, shape in CHECK_SHAPES
                                for model in [catalog.model(p, "gpt-check", **shape)]
                                for lay in search.plain(p, model, ranks, CHECK_BATCH, CHECK_SEQ)]
    bar = tqdm(total=len(checked), desc="plan", file=sys.stderr, leave=False)
    load = os.getloadavg()[0]
    sets = {"cluster": list(time_check(report, p, quick, cache, bar).values())}
    if not quick:
        sets["loopback"] = loopback_check(report, p, cache, bar)
    scored(report, p, sets, catalog.model(p, "gpt", **TIME_MODEL), catalog.policy(p, "float32"))
    check_pol = catalog.policy(p, "float64")
    for label, check_model, lay in checked:
        name = search.name(lay)
        result = measure.run_layout(lay, check_model, CHECK_SEQ, CHECK_BATCH, "float64", steps=2, cache=cache)
        bar.update()
        mem = measure.memory_ratios(p, lay, check_model, check_pol, CHECK_SEQ, CHECK_BATCH, result)
        report.ratios[f"memory_predicted_over_measured: {label}: {name}"] = mem["check"]
        _say(f"{label}, {name}: memory predicted / counted {mem['check']:.4f}"
             + (f" (all ranks; the busiest {mem['peak']:.4f})" if lay.ep > 1 else ""))
    bar.close()
    if not quick:
        tracked(report, p)
    memory = {k: v for k, v in report.ratios.items() if k.startswith("memory_predicted_over_measured")}
    report.add("memory predicted over measured, all layouts", statistics.median(memory.values()), "median",
               min=min(memory.values()), max=max(memory.values()), layouts=len(memory))
    rows = published.compare(p)
    for row in rows:
        report.ratios[f"published_predicted_over_reported: {row['key']}"] = row["ratio"]
    summary = published.summary(rows)
    report.add("published predicted over reported", summary["median"], "median", **summary,
               links=published.SOURCES, rows=rows)
    report.add("headroom", published.headroom(p), "torchtitan's reserved memory over the predicted peak, median",
               model_version=summary["model_version"])
    report.notes.append(f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
                        f"{load:.1f} at the start: the time check ran on chapter 15's emulated cluster, "
                        f"{NODES} nodes x {RANKS_PER_NODE} ranks, links of {LINK} (tc tbf), every rank on "
                        "this machine's 2 cores")
    report.notes.append("no prediction uses a run of the layout it predicts: the inputs are the "
                        "microbenchmarks above and the model's shapes")
    return report
