"""Elastic recovery times: the package's settings against torchrun's defaults.

One scenario per setting, with two local nodes of 2 workers each:
B joins a running A (*join*), B is lost to SIGKILL of its agent and workers
(*node loss*), one of A's workers is killed (*worker crash*). Each time is
from the disturbance to the first training step of the new worker group.
torchrun's side gets only the store-sharing workaround (without it the join
hangs, see chapter 4).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ddpguide.bench.progress import tracked
from ddpguide.bench.report import Report

CASES = ("join", "node_loss", "worker_crash")


class ScenarioError(RuntimeError):
    """A milestone did not arrive in time."""


def _wait(cluster, predicate, what: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.poll()
        found = predicate(cluster.all_events)
        if found:
            return found
        time.sleep(0.02)
    tails = "\n".join(f"--- {n} ---\n{cluster.log_tail(n, 8)}" for n in cluster.nodes)
    raise ScenarioError(f"no {what} within {timeout_s:g} s\n{tails}")


def _first(event: str, after: float, world_size: int | None = None):
    def find(events):
        for e in events:
            if (e["event"] == event and e["t"] > after and e.get("rank") in (0, None)
                    and (world_size is None or e.get("world_size") == world_size)):
                return e
        return None
    return find


def _epoch_done(after: float, world_size: int):
    return _first("epoch", after, world_size)


def scenario(workdir: Path, torchrun_defaults: bool, nproc: int = 2, nnodes: str = "1:2",
             step_delay: float = 0.05, progress=None) -> dict[str, float]:
    """Worker crash, node loss and join, once each; seconds to the first step after each.

    B starts as soon as A hosts the store, so the first round is full and
    closes without waiting for the last call; C's agent starts too but joins
    only on cue. ``progress`` (a :class:`~ddpguide.bench.progress.SuiteProgress`), if given,
    counts and prints each of the four figures as it is measured.
    """
    from ddpguide.elastic.cluster import LocalCluster

    limit = 150.0 if torchrun_defaults else 60.0
    label = "torchrun" if torchrun_defaults else "ddpguide"
    both, one = 2 * nproc, nproc  # world sizes with two nodes and with one
    out: dict[str, float] = {}

    def measured(case: str, seconds: float) -> None:
        out[case] = seconds
        if progress is not None:
            progress.advance(f"{label} {case}", [(f"{label} {case}", seconds, "s")])

    with LocalCluster(workdir, epochs=100_000, step_delay=step_delay, nnodes=nnodes,
                      torchrun_defaults=torchrun_defaults) as cluster:
        cluster.start_node("C", nproc, on_cue=True)
        started = time.monotonic()
        cluster.start_node("A", nproc)
        cluster.wait_for_store(limit)  # A hosts the store: losing B must not take it along
        cluster.start_node("B", nproc)
        step = _wait(cluster, _first("first_step", started, both), "the first step", limit)
        measured("first_start", step["t"] - started)

        _wait(cluster, _epoch_done(step["t"], both), "an epoch with both nodes", limit)
        killed = cluster.kill_worker("A", local_rank=nproc - 1)
        step = _wait(cluster, _first("first_step", killed, both), "a step after the crash", limit)
        measured("worker_crash", step["t"] - killed)

        _wait(cluster, _epoch_done(step["t"], both), "an epoch after the crash", limit)
        lost = cluster.kill_node("B")
        step = _wait(cluster, _first("first_step", lost, one), "a step after the node loss", limit)
        measured("node_loss", step["t"] - lost)

        _wait(cluster, _epoch_done(step["t"], one), "an epoch after the node loss", limit)
        _wait(cluster, lambda ev: any(e["event"] == "agent_waiting" for e in ev), "agent C", limit)
        joined = cluster.join("C")
        step = _wait(cluster, _first("first_step", joined, both), "a step after the join", limit)
        measured("join", step["t"] - joined)
    return out


def run(quick: bool = False) -> Report:
    """Median recovery times: quick, 1 run of 1 worker per node; full, 3 runs of 2 per node.

    torchrun's side alone needs over a minute even in quick mode: losing a
    node costs it 15 s of missed heartbeats plus a 30 s last call.
    """
    from ddpguide.elastic.settings import (
        TORCHRUN_MONITOR_INTERVAL,
        TORCHRUN_RDZV_CONF,
        TUNED_MONITOR_INTERVAL,
        TUNED_RDZV_CONF,
    )

    repeats, nproc = (1, 1) if quick else (3, 2)
    report = Report("elastic")
    results: dict[str, dict[str, list[float]]] = {}
    # four figures per scenario (first start, crash, node loss, join), each counted as measured
    with tracked(report, total=2 * repeats * (len(CASES) + 1), unit="figure") as progress:
        for label, defaults in (("ddpguide", False), ("torchrun", True)):
            runs: dict[str, list[float]] = {}
            for _ in range(repeats):
                workdir = Path(tempfile.mkdtemp(prefix="ddpguide-bench-elastic-"))
                try:
                    measured = scenario(workdir, defaults, nproc=nproc, progress=progress)
                    for case, seconds in measured.items():
                        runs.setdefault(case, []).append(seconds)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
            results[label] = runs
            for case, values in runs.items():
                report.add(f"{label} {case}", statistics.median(values), "s", samples=values)

    for case in CASES:
        report.ratios[f"{case}_s"] = statistics.median(results["ddpguide"][case])
        report.ratios[f"torchrun_{case}_s"] = statistics.median(results["torchrun"][case])
    report.notes.append(
        f"nodes of {nproc} worker(s) on 127.0.0.1, --nnodes 1:2; seconds from the disturbance to "
        "the first step of the new worker group (join: from the cue to an agent that is "
        "already running).")
    report.notes.append(
        f"ddpguide: rdzv {TUNED_RDZV_CONF}, monitor {TUNED_MONITOR_INTERVAL} s, workers "
        f"forked from a warm forkserver; torchrun: rdzv {TORCHRUN_RDZV_CONF}, monitor "
        f"{TORCHRUN_MONITOR_INTERVAL} s, exec'd workers; both with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.")
    return report
