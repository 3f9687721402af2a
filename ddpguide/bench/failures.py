"""Failures at scale (chapter 17): per-step recovery against torchrun's restart, DiLoCo's
bytes against DDP's, and the checkpoint interval against Young-Daly.

- ``ft_recovery_s``: ``ft_train.py``, 2 replica groups, group 1 killed inside step 4; the
  seconds the survivor lost (kill to its next commit, less one ordinary step).
- ``torchrun_recovery_s``: chapter 4's ``elastic_train.py`` under torchrun, one of its 2
  workers killed; kill to the first epoch after the restart, less one ordinary epoch.
- ``diloco_bytes_over_ddp_times_h``: bytes given to Manager.allreduce per inner step by
  DiLoCo with H = 4, over DDP's per step, times H.
- ``young_daly_best_interval_measured_over_predicted``: C measured (synchronous DCP save),
  failures and restarts on a simulated clock (``ddpguide.failures.cadence``).
- ``diloco_step_over_ddp_step_h{4,16}_{measured,predicted}`` (full mode, root): chapter 15's
  cluster, two nodes joined by a ``LINK`` link, one replica group on each (``ft_train.py
  --local-groups K``, torchft's lighthouse on node 0), a model of ``WIDTH`` hidden units
  (1.05 MB of float64). Seconds per (inner) step, DiLoCo with H = 4 and 16 over DDP,
  measured, and predicted from parts measured apart: one group alone on node 0 (the same
  step with no peer) plus the bytes and calls it hands to Manager.allreduce, each call a
  two-rank all-reduce at the alpha and beta of a point-to-point sweep across the link
  (chapter 15's ``collectives.py``), once per step for DDP and once per H inner steps for
  DiLoCo.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from ddpguide.bench.progress import tracked
from ddpguide.bench.report import Report

LINK = "50mbit"           # chapter 15's link between its two nodes
WIDTH = 8192              # ft_train.py --hidden: 131,077 float64 parameters
LIGHTHOUSE_PORT = 29510   # inside the cluster's own namespaces: nothing else uses it
H_VALUES = (4, 16)
SYNCS = {4: 5, 16: 3}     # DiLoCo's syncs per run: 20 and 48 inner steps; DDP: 12 steps

#: the appendix's anchors for this suite: (what, reference, goal)
ANCHORS = {
    "ft_recovery_s": ("seconds a kill costs the surviving torchft replica group (ft_train.py)", "", ""),
    "torchrun_recovery_s": ("seconds a killed worker costs under torchrun (elastic_train.py: restart, "
                            "reload the checkpoint)", "", ""),
    "torchrun_over_ft_recovery": ("torchrun_recovery_s / ft_recovery_s", "", ">= 5"),
    "diloco_bytes_over_ddp_times_h": ("DiLoCo's bytes per inner step / DDP's per step x H", "",
                                      "1.00 +- 0.01"),
    "young_daly_best_interval_measured_over_predicted": (
        "goodput-best checkpoint interval (simulated clock, C measured) / sqrt(2 C M)",
        "Young 1974, Daly 2006", "0.67-1.5"),
    "lost_per_failure_over_tau_half_plus_restart": (
        "work lost per failure at the best interval / (tau / 2 + restart), modelled", "", "about 1"),
    "goodput_checkpointing": ("goodput at the best checkpoint interval, modelled", "", ""),
    "goodput_per_step_ft": ("goodput with per-step fault tolerance, 1 - lost / M, modelled", "", ""),
    **{f"diloco_step_over_ddp_step_h{h}_{kind}": (
        f"seconds per inner step, DiLoCo H={h} / DDP, 2 groups on 2 nodes across a {LINK} link, "
        + ("measured" if kind == "measured" else
           "predicted: one group alone + its all-reduces at the link's swept alpha-beta"),
        "", "") for h in H_VALUES for kind in ("measured", "predicted")},
    "diloco_step_over_ddp_step_measured_over_predicted": (
        "the H above farthest from 1: measured ratio / predicted ratio", "", "0.8-1.25"),
}


def _bytes_per_inner_step(report: dict, key: str) -> float:
    rows = [r for r in report[key] if r["group"] == 0]
    return rows[-1]["bytes"] / len(rows)


def seconds_per_step(report: dict) -> float:
    """Group 0's seconds per (inner) step in steady state: from its first sync (DiLoCo) or
    its second committed step (DDP) to its last, over the (inner) steps between."""
    if report["inner"]:
        rows = sorted((r for r in report["inner"] if r["group"] == 0), key=lambda r: r["inner"])
        syncs = [r for a, r in zip(rows, rows[1:]) if r["step"] > a["step"]]
        first, last = syncs[0], syncs[-1]
        return (last["time"] - first["time"]) / (last["inner"] - first["inner"])
    rows = sorted((r for r in report["step"] if r["group"] == 0 and r["committed"]),
                  key=lambda r: r["step"])[1:]
    return (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"])


def per_sync(report: dict) -> tuple[float, float]:
    """Bytes and Manager.allreduce calls of group 0 per step (DDP) or per sync (DiLoCo)."""
    rows = report["inner"] or [r for r in report["step"] if r["group"] == 0]
    last = max(rows, key=lambda r: r["time"])
    syncs = max(r["step"] for r in rows) if report["inner"] else len(rows)
    return last["bytes"] / syncs, last["calls"] / syncs


def _ft_runs(cluster, args: list[str], groups: int, timeout: float = 240.0) -> dict:
    """ft_train.py ARGS with one replica group on each of the first ``groups`` nodes, and for
    two groups torchft's lighthouse on node 0 (started first, stopped last); group 0's report."""
    from ddpguide.cluster.experiments import ProgramFailed
    from ddpguide.failures.runs import copied
    from ddpguide.launch.ranks import Command, Ranks

    node0 = cluster.nodes[0]
    with tempfile.TemporaryDirectory(prefix="ddpguide-ft-link-") as tmp, Ranks() as lighthouse:
        folder = Path(tmp)
        source = copied(folder)
        common = [sys.executable, str(source), *args, "--step-seconds", "0", "--hidden",
                  str(WIDTH), "--deadline", str(int(timeout) - 20)]
        if groups == 1:
            work = [(node0, [*common, "--groups", "1", "--report", "report0.json"])]
        else:
            log = folder / "lighthouse.log"
            lighthouse.start(Command(
                [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas",
                 str(groups), "--bind", f"[::]:{LIGHTHOUSE_PORT}", "--join_timeout_ms", "30000"],
                env={"RUST_LOG": "info"}, prefix=cluster.prefix(node0), log=log))
            if lighthouse.wait(60, until=lambda: "listening" in log.read_text(errors="replace")
                               if log.exists() else False) != "until":
                raise ProgramFailed(f"torchft_lighthouse on node 0 did not start: {log}")
            work = [(node, [*common, "--groups", str(groups), "--local-groups", str(k),
                            "--lighthouse", f"http://{node0.address}:{LIGHTHOUSE_PORT}",
                            "--hostname", node.address, "--report", f"report{k}.json"])
                    for k, node in enumerate(cluster.nodes[:groups])]
        ended = cluster.run(work, timeout, cwd=folder)
        lighthouse.stop(grace=2.0)
        if any(e.returncode != 0 for e in ended):
            raise ProgramFailed("ft_train.py on the cluster: " + "; ".join(
                f"exit {e.returncode}: {(e.errors or e.output)[-600:]}" for e in ended))
        return json.loads((folder / "report0.json").read_text())


def diloco_on_link(report: Report, progress) -> None:
    """DiLoCo's step time over DDP's across chapter 15's link, measured and predicted."""
    from ddpguide.cluster import Spec, up
    from ddpguide.cluster import model as formulas
    from ddpguide.cluster.experiments import collectives

    modes = {"ddp": ["--steps", "12"], **{f"h{h}": ["--steps", str(SYNCS[h]), "--diloco", str(h)]
                                          for h in H_VALUES}}
    with up(Spec(nodes=2, ranks_per_node=1, link=LINK)) as cluster:
        sweep = collectives(cluster, numel=2**16, sizes=(2**18, 2**19, 2**20, 2**21),
                            repeats=2)["sweep"]
        alpha, beta = formulas.fit_alpha_beta([(p["bytes"], p["seconds"]) for p in sweep])
        report.add("link_alpha", alpha * 1e3, "ms", sweep=sweep, link=LINK)
        report.add("link_beta", beta / 1e6, "MB/s")
        step = {}
        for mode, args in modes.items():
            alone, pair = _ft_runs(cluster, args, 1), _ft_runs(cluster, args, 2)
            nbytes, calls = per_sync(alone)
            h = int(mode[1:]) if mode != "ddp" else 1
            link_s = calls * formulas.flat_time(nbytes / calls, 2, max(alpha, 0.0), beta)
            step[mode] = {"measured": seconds_per_step(pair), "alone": seconds_per_step(alone),
                          "predicted": seconds_per_step(alone) + link_s / h}
            report.add(f"step_{mode}_on_link", step[mode]["measured"], "s",
                       predicted=step[mode]["predicted"], alone=step[mode]["alone"],
                       bytes_per_sync=nbytes, calls_per_sync=calls, link_s_per_sync=link_s)
            progress.advance(f"{mode} on the link", [(f"{mode} step", step[mode]["measured"], "s")])
    worst = 1.0
    for h in H_VALUES:
        for kind in ("measured", "predicted"):
            report.ratios[f"diloco_step_over_ddp_step_h{h}_{kind}"] = \
                step[f"h{h}"][kind] / step["ddp"][kind]
        ratio = (report.ratios[f"diloco_step_over_ddp_step_h{h}_measured"]
                 / report.ratios[f"diloco_step_over_ddp_step_h{h}_predicted"])
        worst = max(worst, ratio, key=lambda v: abs(v - 1.0))
    report.ratios["diloco_step_over_ddp_step_measured_over_predicted"] = worst


def run(quick: bool = False) -> Report:
    """Quick: the DiLoCo bytes and the checkpoint sweep (no torchrun run, one short kill run)."""
    from ddpguide.failures import cadence, runs

    report = Report("failures")
    h = 2 if quick else 4
    from ddpguide.cluster.netns import missing_prerequisite

    link = not quick and missing_prerequisite() is None
    with tracked(report, total=5 + (1 + len(H_VALUES) if link else 0), unit="figure") as progress:
        ddp = runs.run_ft("--steps", str(4 * h))
        diloco = runs.run_ft("--steps", "4", "--diloco", str(h))
        ratio = _bytes_per_inner_step(diloco, "inner") / _bytes_per_inner_step(ddp, "step") * h
        progress.advance("diloco bytes", [("diloco bytes per inner step over ddp's x H", ratio, "")])
        report.ratios["diloco_bytes_over_ddp_times_h"] = ratio

        killed = runs.run_ft("--steps", "12", "--kill-group", "1", "--at", "4")
        ft = statistics.median(runs.ft_lost_s(killed))
        report.add("ft_train lost per kill", ft, "s")
        report.ratios["ft_recovery_s"] = ft
        progress.advance("ft recovery", [("ft lost", ft, "s")])
        if not quick:
            torchrun = runs.torchrun_lost_s()
            report.add("torchrun lost per kill", torchrun["lost_s"], "s", **torchrun)
            report.ratios["torchrun_recovery_s"] = torchrun["lost_s"]
            report.ratios["torchrun_over_ft_recovery"] = torchrun["lost_s"] / ft
            progress.advance("torchrun recovery", [("torchrun lost", torchrun["lost_s"], "s")])

        cost = cadence.checkpoint_cost(8 if quick else 32, 1 if quick else 3)
        for name in ("sync_s", "async_stall_s", "async_total_s"):
            report.add(f"dcp {name}", cost[name], "s", megabytes=cost["megabytes"])
        progress.advance("checkpoint cost", [("dcp sync", cost["sync_s"], "s")])
        step_s, mtbf_s = 0.05, 60.0
        restart_s = report.ratios.get("torchrun_recovery_s", 2.0)
        sweep = cadence.sweep(step_s, cost["sync_s"], mtbf_s, restart_s)
        report.ratios["young_daly_best_interval_measured_over_predicted"] = \
            sweep["best_over_predicted"]
        best = sweep["best"]
        report.ratios["lost_per_failure_over_tau_half_plus_restart"] = \
            best["lost_per_failure_s"] / best["lost_predicted_s"]
        report.ratios["goodput_checkpointing"] = best["goodput"]
        report.ratios["goodput_per_step_ft"] = cadence.per_step_goodput(step_s, mtbf_s, ft)
        progress.advance("young-daly", [("best over predicted", sweep["best_over_predicted"], "")])
        if link:
            diloco_on_link(report, progress)
    report.notes.append(
        "recoveries on 127.0.0.1, 2 groups of 1 process (ft) / 2 workers (torchrun); the "
        f"checkpoint sweep is modelled: step {step_s} s, mean time between failures {mtbf_s} s, "
        "restart = torchrun's measured recovery, C = the measured synchronous DCP save.")
    if link:
        report.notes.append(
            f"DiLoCo against DDP: chapter 15's cluster, 2 nodes joined by a {LINK} tbf link, one "
            "group on each; predicted from one group alone on node 0 and the link's alpha-beta "
            "fitted to a point-to-point sweep across it, never from the runs predicted.")
    return report
