"""The plan suite's time check on loopback, and each term of the model doubled against all its
measured layouts (chapter 16).

On this machine's loopback (no link limit, so compute is most of some steps) the
:data:`LOOPBACK` layouts of GPTs of several widths run with ``train.py --cost --rate-window``.
Each is predicted twice: from ``plan_measure.py --measure`` and ``--sweep`` run just before it
with as many ranks (the matmul table, the cores busy processes got, the loopback link:
``..._loopback_table``), and with the compute rate its own ranks got, timed in windows of
:data:`RATE_WINDOW` s between its steps (:mod:`ddpguide.plan.calibrate`:
``step_predicted_over_measured_loopback``, ``rank_correlation_loopback``). No prediction reads
the step it predicts.

The layouts were chosen from predictions alone, before any of them was measured for this
check: every plain layout of two ranks (DDP, FSDP, TP, CP, PP) of GPTs 32 to 512 wide at
sequence 64, batch 8 and sequence 128, batch 16, predicted on a table of this machine
(``--measure --ranks 2`` and ``--sweep``, 2026-12-07 23:12 UTC), and one of each kind taken
at compute shares spread from under a quarter of the step to over three quarters: 0.08
(CP 2, 32 wide), 0.15 (FSDP 2, 32), 0.30 (TP 2, 64), 0.41 (PP 2, 128), 0.60 (CP 2, 128),
0.70 (TP 2, 256), 0.86 (FSDP 2, 256), 0.95 (DDP 2, 512). Their measured steps played no
part in the choice. The earlier four were CP 4, TP 4 and DDP 4, four ranks on two cores,
and DDP 2 at 768 wide.

``python -m ddpguide.bench.plan_loopback --add FILE`` runs these alone and puts them into a
saved report of the plan suite in place of its loopback rows: the cluster's rows stay as
they were measured, and the doubled terms and compute shares are scored again over both
(the cluster's rows predicted from the saved cluster hardware), with a note of its own time
and load. Each loopback prediction and the run it predicts are measured together, so they do
not depend on when the rest of the suite ran.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

from ddpguide.bench.report import Report
from ddpguide.plan import calibrate, catalog, checks, measure, perturb, saved, search
from ddpguide.plan.checks import TIME_BATCH, TIME_MODEL, TIME_SEQ

#: the time check on loopback (no link limit): (the GPT's width, ranks, sequence, batch, layout),
#: two ranks each (one a core: four on two cores is oversubscription the model does not price),
#: in the order of their predicted compute share (see the module's docstring)
LOOPBACK: tuple[tuple[int, int, int, int, str], ...] = (
    (32, 2, 64, 8, "CP 2"), (32, 2, 64, 8, "FSDP 2"), (64, 2, 64, 8, "TP 2"), (128, 2, 64, 8, "PP 2, 1F1B m2"),
    (128, 2, 128, 16, "CP 2"), (256, 2, 128, 16, "TP 2"), (256, 2, 128, 16, "FSDP 2"), (512, 2, 128, 16, "DDP 2"))
#: seconds of each window in which all of a run's ranks time a matmul together, before each step
RATE_WINDOW = 0.5
#: what ``--add`` replaces in a saved report: these measurements and ratios
MEASUREMENTS = ("loopback ", "each term of the model doubled")
RATIOS = ("step_predicted_over_measured_loopback", "rank_correlation_loopback", "perturbed_", "compute_share_")
NOTE = "loopback rows:"


def _say(line: str) -> None:
    print(line, flush=True)


def loopback_check(report: Report, p, cache: str | None, bar) -> list[dict]:
    """The :data:`LOOPBACK` layouts run on this machine's loopback with ``train.py --cost``, each
    just after this machine's hardware is measured for it (:func:`measure.run_beside`: the
    matmul table, the cores and the loopback link of as many ranks as the layout has), and
    predicted twice: from that table, and with the compute rate measured in the run's own
    ranks between its steps (:mod:`ddpguide.plan.calibrate`: a matmul timed in each rank's
    process, never the steps). A cached run comes back with the table measured beside it.
    The rows, with their hardware, for the perturbation check."""
    pol = catalog.policy(p, "float32")
    bar.total += len(LOOPBACK)
    rows = []
    for dim, ranks, seq, batch, name in LOOPBACK:
        model = catalog.model(p, "gpt", layers=2, dim=dim, heads=4, ffn=4 * dim)
        lay = next(x for x in search.plain(p, model, ranks, batch, seq) if search.name(x) == name)
        label = f"dim {dim}, {name}"
        load = os.getloadavg()[0]
        hw, result = measure.run_beside(p, lay, model, seq, batch, "float32", steps=5, cache=cache,
                                        rate_window=RATE_WINDOW)
        bar.update()
        here = calibrate.beside(p, hw, model, lay, batch, seq, result)
        table, step = (p.step(model, lay, pol, h, batch, seq) for h in (hw, here))
        measured = result["step_seconds"]
        rows.append({"name": label, "layout": lay, "model": model, "batch": batch, "seq": seq, "hardware": here,
                     "predicted": step["total"], "measured": measured, "share": step["compute"] / step["total"]})
        report.ratios[f"step_predicted_over_measured_loopback: {label}"] = step["total"] / measured
        report.ratios[f"step_predicted_over_measured_loopback_table: {label}"] = table["total"] / measured
        report.add(f"loopback {label}: step", measured * 1e3, "ms", predicted_ms=step["total"] * 1e3,
                   table_predicted_ms=table["total"] * 1e3, compute_share=rows[-1]["share"],
                   rate_scale=calibrate.scale(p, hw, model, lay, batch, seq, result), load_before=load,
                   cores=hw.cores, cores_in_ranks=here.cores, rank_gflop_s=calibrate.rate(lay, result) / 1e9,
                   shared_gflop_s=result["shared_flops"] / 1e9, rate_window_s=RATE_WINDOW,
                   shared_windows_gflop_s=[[r / 1e9 for r in w] for w in result["shared_windows"]],
                   links=hw.links, peak_gflop_s=hw.peak / 1e9, table_at=result.get("measured_at"),
                   table_then_run_seconds=result.get("beside_seconds"),
                   record={k: result[k] for k in ("peak_flops", "alone_flops", "shared_flops")},
                   hardware={k: v for k, v in vars(hw).items() if k != "sweep"})
        _say(f"loopback {label}: step predicted {step['total'] * 1e3:.0f} ms from its ranks' rate "
             f"({step['total'] / measured:.2f}), {table['total'] * 1e3:.0f} ms from its table "
             f"({table['total'] / measured:.2f}), measured {measured * 1e3:.0f} ms; compute "
             f"{rows[-1]['share']:.2f} of the step; {here.cores:.2f} cores in the ranks, {hw.cores:.2f} "
             f"in the table's; load {load:.1f}")
    predicted, measured = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    report.ratios["rank_correlation_loopback"] = checks.spearman(predicted, measured)
    return rows


def scored(report: Report, p, sets: dict[str, list[dict]], model, pol) -> None:
    """Each term of the model doubled, against each set of measured layouts (the cluster's, and
    loopback's with their own model in each row; each row holds its hardware): ``perturbed_<term>_out_of_band``
    is 1 when the doubling fails the check on any set; the predicted compute share of every
    layout of every set, its least and most."""
    found = {name: perturb.check(p, rows, model, pol, None, TIME_BATCH, TIME_SEQ) for name, rows in sets.items()}
    for term in perturb.TERMS:
        report.ratios[f"perturbed_{term}_out_of_band"] = max(f[term]["out_of_band"] for f in found.values())
    shares = [x for rows in sets.values() for x in perturb.shares(p, rows, model, pol, None, TIME_BATCH, TIME_SEQ)]
    report.ratios["compute_share_min"], report.ratios["compute_share_max"] = min(shares), max(shares)
    failing = sum(report.ratios[f"perturbed_{t}_out_of_band"] for t in perturb.TERMS)
    report.add("each term of the model doubled", failing, "terms whose doubling fails the check",
               **{f"{name}: {t}": {k: v for k, v in f[t].items() if k != "inside"} for name, f in found.items()
                  for t in perturb.TERMS})


def cluster_rows(p, bench: dict) -> list[dict]:
    """The saved run's cluster layouts as :func:`scored` takes them: each with its measured step
    and the saved cluster hardware."""
    hw = saved.cluster_hardware(p, bench)
    return [{**row, "hardware": hw} for row in saved.rows(p, bench)]


def merged(bench: dict, report: Report, note: str) -> dict:
    """The saved report ``bench`` with its loopback rows, doubled terms and compute shares
    replaced by ``report``'s, and ``note`` in place of an earlier one of its kind."""
    new = report.to_dict()
    out = dict(bench)
    out["measurements"] = [m for m in bench["measurements"] if not m["name"].startswith(MEASUREMENTS)]
    out["measurements"] += new["measurements"]
    out["ratios"] = {k: v for k, v in bench["ratios"].items() if not k.startswith(RATIOS)} | new["ratios"]
    out["notes"] = [n for n in bench["notes"] if not n.startswith(NOTE)] + [note]
    return out


def add_to(path: Path, cache: str | None = None) -> dict:
    """Run the loopback check alone and put it into the plan report saved at ``path`` (written
    whole): :func:`merged`, the doubled terms scored over the saved cluster rows and the new ones."""
    from tqdm.auto import tqdm

    from ddpguide.core.commands import write_atomically

    bench = json.loads(path.read_text())
    p = search.program()
    at, load, start = (datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       os.getloadavg()[0], time.monotonic())
    report = Report("plan")
    bar = tqdm(total=0, desc="plan loopback", file=sys.stderr, leave=False)
    sets = {"cluster": cluster_rows(p, bench), "loopback": loopback_check(report, p, cache, bar)}
    bar.close()
    scored(report, p, sets, catalog.model(p, "gpt", **TIME_MODEL), catalog.policy(p, "float32"))
    note = (f"{NOTE} measured alone from {at}, {(time.monotonic() - start) / 60:.1f} min, load average "
            f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end, by python -m "
            "ddpguide.bench.plan_loopback --add; the doubled terms and compute shares scored over them "
            "and the cluster rows above, which are the suite's own")
    out = merged(bench, report, note)
    write_atomically(path, json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    from ddpguide.core.commands import OneLineParser

    parser = OneLineParser(prog="python -m ddpguide.bench.plan_loopback", description=__doc__.splitlines()[0])
    parser.add_argument("--add", metavar="FILE", required=True,
                        help="a saved report of the plan suite, whose loopback rows are measured again")
    args = parser.parse_args(argv)
    path = Path(args.add)
    try:
        bench = json.loads(path.read_text())
        ok = bench.get("suite") == "plan" and any(m["name"] == "cluster hardware" for m in bench["measurements"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        ok = False
    if not ok:
        parser.error(f"--add {path}: not a saved report of the plan suite (with its cluster hardware)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = add_to(path, os.environ.get("DDPGUIDE_PLAN_CACHE"))
    loop = {k: v for k, v in out["ratios"].items() if k.startswith("step_predicted_over_measured_loopback:")}
    print(f"{sum(0.8 <= v <= 1.25 for v in loop.values())} of {len(loop)} loopback layouts within 0.8-1.25; "
          f"rank_correlation_loopback {out['ratios']['rank_correlation_loopback']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
