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
- ``young_daly_best_interval_simulated_over_predicted`` and
  ``daly_best_interval_simulated_over_predicted``: the goodput-best checkpoint interval of a
  simulation (``ddpguide.failures.cadence``: C measured, a synchronous DCP save; failures and
  restarts on a simulated clock) over Young's sqrt(2 C M) and over Daly's higher-order optimum.
  Simulated, not measured on a run: a saved report from before the rename (the ratio was
  ``..._measured_over_predicted``) is migrated by ``migrate(path)``, which re-runs that
  seeded simulation from the report's own C and restart time.
- ``torchrun_over_ft_recovery_cluster`` (full mode, as root): the same two recoveries on
  chapter 15's cluster, one link lost (``failures_cluster``, whose parts it reports), with
  ``stall_measured_over_predicted_link``.
- ``rejoin_measured_over_predicted_kill_1gb`` (full mode): with 1 GiB more state (``failures_state``).
- ``stall_measured_over_predicted_<kind>`` and ``rejoin_measured_over_predicted_<kind>`` for
  ``term`` (SIGTERM: the rank ends, the kernel closes its sockets; torchrun restarts it, its
  exit status being non-zero), ``kill`` (SIGKILL) and ``hang`` (SIGSTOP, then SIGKILL after
  the collective's timeout + 1 s), one run of 2 groups of 1 rank, the three in turn (hang,
  kill, term; the quick mode: kill alone).

The predictions, from the run's configured values only: T the collective's timeout
(``--timeout``), H the lighthouse's heartbeat timeout, J its join timeout, k its quorum tick,
s the program's step sleep, m torchrun's monitor interval (0.1 s). For a failure at t_f,
t_0 is the survivor's last commit before it and r = t_0 + s the moment it asks for its next
quorum. The measured stall is ``runs.lost_s``: how much later the survivor's commits come
than ordinary steps would, i.e. how much later than r its next quorum forms.

- stall, ``term`` and ``kill``: the survivor's all-reduce with the victim fails at once (the
  socket is closed); the lighthouse leaves the victim out when its heartbeat is H old or when
  J has passed since the survivor asked, whichever is first, on its next tick:
  ``max(0, min(t_f + H, r + J) - r) + k / 2``.
- stall, ``hang``: the stopped rank's heartbeat stops too, so the same, unless the survivor
  was already inside an all-reduce with the victim (a ``contributed`` row with every group in
  it, after t_f, before its next commit): it waits out T, sleeps s, and the next quorum
  forms at once: ``T + s + k / 2``.
- rejoin (the failure's SIGKILL or SIGTERM to the new incarnation's ``healed`` row): torchrun
  notices (m / 2 on average), starts a new interpreter that runs ``ft_train.py`` up to its
  built Manager (its imports, its checks of the options, the lighthouse's probe, the Manager
  with its server and store client: P), the survivor asks for a quorum within a step
  ((s + k) / 2 on average), and the heal moves the state's bytes B over loopback at the
  bandwidth W (a 64 MB transfer over a loopback TCP socket, timed here):
  ``m / 2 + P + (s + k) / 2 + B / W``. P is timed beside each failure, in the same run and
  under its load: a separate start of the same program (``runs.StartProbe``: a restarted
  group's rank, against a lighthouse of its own) is timed from its exec to its ``started``
  row, just before the failure is injected and again once every group is back after it
  (never beside the rejoin it predicts: the two would share the cores); P is their median.
  A hang's first probe runs before the SIGSTOP. A group of one rank meets in ms: not summed.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from ddpguide.bench import failures_cluster, failures_state
from ddpguide.bench.failures_state import loopback_bytes_per_s, probed_start_s, rejoin_measured_s, rejoin_predicted_s
from ddpguide.bench.progress import tracked
from ddpguide.bench.report import Report

#: the failure kinds whose stall and rejoin are predicted, and what each is
KINDS = {"hang": "SIGSTOP", "kill": "SIGKILL", "term": "SIGTERM"}   # the longest first

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
    "young_daly_best_interval_simulated_over_predicted": (
        "goodput-best checkpoint interval of a simulation (C measured) / Young's sqrt(2 C M)",
        "Young 1974", "0.67-1.5"),
    "daly_best_interval_simulated_over_predicted": (
        "goodput-best checkpoint interval of a simulation (C measured) / Daly's higher-order "
        "optimum", "Daly 2006", "0.67-1.5"),
    "lost_per_failure_over_tau_half_plus_restart": (
        "work lost per failure at the best interval / (tau / 2 + restart), modelled", "", "about 1"),
    "goodput_checkpointing": ("goodput at the best checkpoint interval, modelled", "", ""),
    "goodput_per_step_ft": ("goodput with per-step fault tolerance, 1 - lost / M, modelled", "", ""),
    **{f"stall_measured_over_predicted_{k}": (
        f"survivor's stall after {what} / min(heartbeat, join) or the collective's timeout, "
        "as this module's docstring", "torchft lighthouse", "0.8-1.25") for k, what in KINDS.items()},
    **{f"rejoin_measured_over_predicted_{k}": (
        f"{what} to the new incarnation healed / process start + quorum + heal bytes",
        "torchrun, torchft", "0.8-1.25") for k, what in KINDS.items()},
    **failures_cluster.ANCHORS, **failures_state.ANCHORS,
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


def stall_predicted_s(report: dict, failure: dict, settings) -> float:
    """The survivor's stall after ``failure``, from the configured timeouts (module docstring;
    a cut link silences its node as SIGSTOP silences a rank: the same prediction)."""
    from ddpguide.failures import chaos

    spared = min(g for g in range(report["groups"]) if g not in failure["groups"])
    commits = sorted(r["time"] for r in report["step"] if r["committed"] and r["rank"] == 0
                     and r["group"] == spared)
    t_f, s, tick = failure["time"], settings.step_seconds, settings.quorum_tick_ms / 1000
    r = max(t for t in commits if t <= t_f) + s
    following = min((t for t in commits if t > t_f), default=float("inf"))
    if failure["what"] in chaos.SILENT and any(
            row["group"] == spared and t_f < row["time"] < following
            and row["participants"] == report["groups"] for row in report["contributed"]):
        return settings.timeout_s + s + tick / 2
    return max(0.0, min(t_f + settings.heartbeat_timeout_ms / 1000,
                        r + settings.join_timeout_ms / 1000) - r) + tick / 2


def recovery(report: Report, chaos_run: dict, settings, bandwidth: float) -> None:
    """The stall and rejoin ratios of each kind, from the run of the three failures in turn;
    each rejoin predicted with the P timed beside its failure (``probed_start_s``)."""
    from ddpguide.failures import runs

    report.add("loopback W", bandwidth / 1e6, "MB/s", heal_bytes=runs.heal_bytes(settings))
    stalled = {"SIGTERM (term)": "term", "SIGKILL (kill)": "kill", "SIGSTOP": "hang"}
    for failure in chaos_run["failures"]:
        kind = stalled.get(failure["what"])
        if kind is not None and f"stall_measured_over_predicted_{kind}" not in report.ratios:
            measured, predicted = runs.lost_s(chaos_run, failure), stall_predicted_s(
                chaos_run, failure, settings)
            if measured is not None:
                report.add(f"stall {kind}", measured, "s", predicted_s=predicted)
                report.ratios[f"stall_measured_over_predicted_{kind}"] = measured / predicted
        ended = "hang" if failure.get("after") == "SIGSTOP" else kind
        if ended is not None and f"rejoin_measured_over_predicted_{ended}" not in report.ratios:
            measured = rejoin_measured_s(chaos_run, failure)
            if measured is not None and not (ended == "hang" and failure["what"] == "SIGSTOP"):
                start_s = probed_start_s(failure)
                rejoin_pred = rejoin_predicted_s(settings, start_s, bandwidth)
                report.add(f"process start P {ended}", start_s, "s", before_s=failure["start_s"],
                           after_s=failure.get("start_after_s"))
                report.add(f"rejoin {ended}", measured, "s", predicted_s=rejoin_pred,
                           start_s=start_s)
                report.ratios[f"rejoin_measured_over_predicted_{ended}"] = measured / rejoin_pred


STEP_S, MTBF_S = 0.05, 60.0   # the simulated loop's step and mean time between failures
OLD_NAME = "young_daly_best_interval_measured_over_predicted"


def interval_ratios(ratios: dict, sync_s: float, restart_s: float, ft_lost_s: float) -> dict:
    """The checkpoint interval's ratios into ``ratios``, from the simulated sweep; the sweep."""
    from ddpguide.failures import cadence

    sweep = cadence.sweep(STEP_S, sync_s, MTBF_S, restart_s)
    ratios["young_daly_best_interval_simulated_over_predicted"] = sweep["best_over_predicted"]
    ratios["daly_best_interval_simulated_over_predicted"] = sweep["best_over_daly"]
    best = sweep["best"]
    ratios["lost_per_failure_over_tau_half_plus_restart"] = \
        best["lost_per_failure_s"] / best["lost_predicted_s"]
    ratios["goodput_checkpointing"] = best["goodput"]
    ratios["goodput_per_step_ft"] = cadence.per_step_goodput(STEP_S, MTBF_S, ft_lost_s)
    return sweep


def migrate(path: str | Path) -> dict:
    """A saved report with the Young ratio's old name: the seeded sweep re-run from its own C
    ("dcp sync_s") and restart, which must give its figures again; then the ratio renamed,
    Daly's added, the file written whole. The migrated ratios."""
    import json

    from ddpguide.core.commands import write_atomically

    path = Path(path)
    saved = json.loads(path.read_text())
    ratios = saved["ratios"]
    sync_s = next(m["value"] for m in saved["measurements"] if m["name"] == "dcp sync_s")
    again: dict = {}
    interval_ratios(again, sync_s, ratios.get("torchrun_recovery_s", 2.0), ratios["ft_recovery_s"])
    old = ratios.pop(OLD_NAME)
    if again["young_daly_best_interval_simulated_over_predicted"] != old or any(
            again[k] != ratios[k] for k in ("goodput_checkpointing", "goodput_per_step_ft")):
        raise ValueError(f"{path}: the sweep re-run does not give its saved figures")
    ratios.update(again)
    saved["notes"].append(f"{OLD_NAME} renamed young_daly_best_interval_simulated_over_predicted "
                          "and daly_best_interval_simulated_over_predicted added by "
                          "ddpguide.bench.failures.migrate (the sweep re-run from the saved C)")
    write_atomically(path, json.dumps(saved, indent=2) + "\n")
    return again


def run(quick: bool = False) -> Report:
    """Quick: the DiLoCo bytes and the checkpoint sweep (no torchrun run, one short kill run)."""
    from ddpguide.failures import cadence, engine, runs

    report = Report("failures")
    h = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="ddpguide-failures-") as tmp, \
            tracked(report, total=6, unit="figure") as progress:
        steps = 40 if quick else 200
        ft_run = runs.run_ft(Path(tmp, "ft"), steps=steps, min_replicas=2, step_seconds=0.0)
        diloco = runs.run_ft(Path(tmp, "diloco"), steps=4, min_replicas=2,
                             extra=("--diloco", str(h)))
        ratio = _bytes_per_inner_step(diloco, "inner") / _bytes_per_inner_step(ft_run, "step") * h
        progress.advance("diloco bytes", [("diloco bytes per inner step over ddp's x H", ratio, "")])
        report.ratios["diloco_bytes_over_ddp_times_h"] = ratio

        plain = runs.run_plain_ddp(Path(tmp, "plain"), steps)
        ft_step, ddp_step = seconds_per_step(ft_run), seconds_per_step(plain)
        report.add("torchft step", ft_step, "s", steps=steps)
        report.add("plain DDP step", ddp_step, "s", steps=steps,   # like for like: same weights
                   same_weights=last_weights(ft_run) == last_weights(plain))
        report.ratios["ft_step_over_ddp_step"] = ft_step / ddp_step
        progress.advance("ft step over ddp step", [("ratio", ft_step / ddp_step, "")])

        bandwidth = loopback_bytes_per_s()
        kinds = ("kill",) if quick else tuple(KINDS)
        step_s, gap_s = 0.05, (0.2, 0.5)
        with runs.StartProbe(Path(tmp, "probe")) as probe:
            # the run ends once its failures are done and every group is back (run.run): the
            # steps only bound it
            settings = engine.Settings(steps=4000, step_seconds=step_s, deadline_s=300.0)
            chaos_run = runs.run_ft(Path(tmp, "chaos"), failures=len(kinds), seed=1,
                                    kinds=kinds, in_order=True, hang_ends=(signal.SIGKILL,),
                                    gap_s=gap_s, before=probe, steps=settings.steps,
                                    after=None if quick else lambda k: {
                                        "start_after_s": probe(k)["start_s"]},
                                    step_seconds=step_s, deadline_s=settings.deadline_s)
        report.add("chaos run", chaos_run["seconds"], "s", failures=[
            f["what"] for f in chaos_run["failures"]], failed_checks=[
            c["name"] for c in chaos_run["checks"] if not c["ok"]])
        recovery(report, chaos_run, settings, bandwidth)
        ft = next((m.value for m in report.measurements if m.name == "stall kill"), None)
        if ft is None:
            raise RuntimeError(f"the chaos run measured no kill: {chaos_run['failures']}")
        report.ratios["ft_recovery_s"] = ft
        progress.advance("ft recovery", [("ft lost", ft, "s")])
        if not quick:
            torchrun = runs.torchrun_lost_s()
            report.add("torchrun lost per kill", torchrun["lost_s"], "s", **torchrun)
            report.ratios["torchrun_recovery_s"] = torchrun["lost_s"]
            report.ratios["torchrun_over_ft_recovery"] = torchrun["lost_s"] / ft
            progress.advance("torchrun recovery", [("torchrun lost", torchrun["lost_s"], "s")])
            from ddpguide.cluster.netns import missing_prerequisite

            if missing_prerequisite() is None:
                failures_cluster.run(report, Path(tmp, "cluster"), settings, stall_predicted_s)
            else:
                report.notes.append(f"no cluster run: {missing_prerequisite()}")
            failures_state.run(report, Path(tmp, "state"), bandwidth)

        cost = cadence.checkpoint_cost(8 if quick else 32, 1 if quick else 3)
        for name in ("sync_s", "async_stall_s", "async_total_s"):
            report.add(f"dcp {name}", cost[name], "s", megabytes=cost["megabytes"])
        progress.advance("checkpoint cost", [("dcp sync", cost["sync_s"], "s")])
        sweep = interval_ratios(report.ratios, cost["sync_s"],
                                report.ratios.get("torchrun_recovery_s", 2.0), ft)
        progress.advance("young-daly", [("best over Young's", sweep["best_over_predicted"], "")])
    report.notes.append(
        "recoveries on 127.0.0.1, 2 groups of 1 process (ft) / 2 workers (torchrun); the "
        f"checkpoint sweep is modelled: step {STEP_S} s, mean time between failures {MTBF_S} s, "
        "restart = torchrun's measured recovery, C = the measured synchronous DCP save.")
    return report
