"""Failures at scale (chapter 17): per-step recovery against torchrun's restart, DiLoCo's
bytes against DDP's, and the checkpoint interval against Young-Daly.

- ``ft_recovery_s``: ``ft_train.py`` under the engine (torchft's lighthouse, one torchrun per
  replica group), 2 groups, one rank killed with SIGKILL from outside; the seconds the
  survivor lost (its commits around the kill, less the ordinary steps between).
- ``torchrun_recovery_s``: chapter 4's ``elastic_train.py`` under torchrun, one of its 2
  workers killed; kill to the first epoch after the restart, less one ordinary epoch.
- ``diloco_bytes_over_ddp_times_h``: bytes given to Manager.allreduce per inner step by
  DiLoCo with H = 4, over DDP's per step, times H.
- ``ft_step_over_ddp_step``: ``ft_train.py``'s steady-state step time under torchft (2 groups
  of 1, a quorum per step, the Manager's all-reduce waited inside the backward by the comm
  hook, a commit vote) over the same program's ``--plain-ddp`` step (torch's DDP over
  torchrun's 2 ranks): the same model, per-rank batch, gloo, no sleep, in the same run.
- ``young_daly_best_interval_measured_over_predicted``: C measured (synchronous DCP save),
  failures and restarts on a simulated clock (``ddpguide.failures.cadence``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from ddpguide.bench.progress import tracked
from ddpguide.bench.report import Report

#: the appendix's anchors for this suite: (what, reference, goal)
ANCHORS = {
    "ft_recovery_s": ("seconds a kill costs the surviving torchft replica group (ft_train.py)", "", ""),
    "torchrun_recovery_s": ("seconds a killed worker costs under torchrun (elastic_train.py: restart, "
                            "reload the checkpoint)", "", ""),
    "torchrun_over_ft_recovery": ("torchrun_recovery_s / ft_recovery_s", "", ">= 5"),
    "diloco_bytes_over_ddp_times_h": ("DiLoCo's bytes per inner step / DDP's per step x H", "",
                                      "1.00 +- 0.01"),
    "ft_step_over_ddp_step": ("ft_train.py's step under torchft / under torch's plain DDP "
                              "(same model and batch, no sleep)", "torchft/ddp.py", ""),
    "young_daly_best_interval_measured_over_predicted": (
        "goodput-best checkpoint interval (simulated clock, C measured) / sqrt(2 C M)",
        "Young 1974, Daly 2006", "0.67-1.5"),
    "lost_per_failure_over_tau_half_plus_restart": (
        "work lost per failure at the best interval / (tau / 2 + restart), modelled", "", "about 1"),
    "goodput_checkpointing": ("goodput at the best checkpoint interval, modelled", "", ""),
    "goodput_per_step_ft": ("goodput with per-step fault tolerance, 1 - lost / M, modelled", "", ""),
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


def last_weights(report: dict) -> str:
    """Group 0's weights digest after its last committed step."""
    return max((r for r in report["step"] if r["group"] == 0 and r["committed"]),
               key=lambda r: r["step"])["weights"]


def run(quick: bool = False) -> Report:
    """Quick: the DiLoCo bytes and the checkpoint sweep (no torchrun run, one short kill run)."""
    from ddpguide.failures import cadence, runs

    report = Report("failures")
    h = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="ddpguide-failures-") as tmp, \
            tracked(report, total=6, unit="figure") as progress:
        ddp = runs.run_ft(Path(tmp, "ddp"), steps=4 * h, min_replicas=2)
        diloco = runs.run_ft(Path(tmp, "diloco"), steps=4, min_replicas=2,
                             extra=("--diloco", str(h)))
        ratio = _bytes_per_inner_step(diloco, "inner") / _bytes_per_inner_step(ddp, "step") * h
        progress.advance("diloco bytes", [("diloco bytes per inner step over ddp's x H", ratio, "")])
        report.ratios["diloco_bytes_over_ddp_times_h"] = ratio

        steps = 40 if quick else 200
        ft_run = runs.run_ft(Path(tmp, "ft"), steps=steps, min_replicas=2, step_seconds=0.0)
        plain = runs.run_plain_ddp(Path(tmp, "plain"), steps)
        ft_step, ddp_step = seconds_per_step(ft_run), seconds_per_step(plain)
        report.add("torchft step", ft_step, "s", steps=steps)
        report.add("plain DDP step", ddp_step, "s", steps=steps,   # like for like: same weights
                   same_weights=last_weights(ft_run) == last_weights(plain))
        report.ratios["ft_step_over_ddp_step"] = ft_step / ddp_step
        progress.advance("ft step over ddp step", [("ratio", ft_step / ddp_step, "")])

        killed = runs.run_ft(Path(tmp, "kill"), failures=1, seed=1, kinds=("kill",), steps=60)
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
    report.notes.append(
        "recoveries on 127.0.0.1, 2 groups of 1 process (ft) / 2 workers (torchrun); the "
        f"checkpoint sweep is modelled: step {step_s} s, mean time between failures {mtbf_s} s, "
        "restart = torchrun's measured recovery, C = the measured synchronous DCP save.")
    return report
