"""torchft's replica groups as Slurm jobs: the lighthouse one job, each group its own job.

:func:`group_lost` submits ``cluster/slurm_torchft_lighthouse.sbatch`` on node 0 and one
``cluster/slurm_torchft_group.sbatch`` job (``--requeue``, a whole node) per replica group
of chapter 17's ``ft_train.py``; once the last group has committed some steps its node is
lost (its link cut, its ``slurmd`` and every process on it killed), Slurm marks the node
DOWN and requeues that group's job on the spare node, where the group joins a quorum and
heals from a live peer while the other group keeps committing. The rows of every
allocation become one report (``failures.engine.assemble``), checked with chapter 17's
invariants (``failures.checks``).

torchrun numbers its restarts from 0 again in each allocation, so the rows of allocation
``a`` (its own folder, ``allocation<a>/rows``) get incarnation ``a * ALLOCATION + n``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpguide.failures import checks, engine
from ddpguide.launch import programs
from ddpguide.slurm import jobs
from ddpguide.slurm.runs import expand
from ddpguide.slurm.scheduler import Slurm

LIGHTHOUSE_RECIPE = jobs.ROOT / "cluster" / "slurm_torchft_lighthouse.sbatch"
GROUP_RECIPE = jobs.ROOT / "cluster" / "slurm_torchft_group.sbatch"
LIGHTHOUSE_PORT = 29510
ALLOCATION = 100  # incarnations of one allocation: torchrun's --max-restarts is far below
NODES = 4         # the lighthouse's, one per group, and a spare for the requeued group
STALL_BOUND_S = 30.0


@dataclass
class FtRun:
    """The run's report (with its checks), the group jobs' fields at the end, and times."""

    report: dict
    fields: list[dict[str, str]]
    times: dict[str, float] = field(default_factory=dict)


def settings(steps: int, step_seconds: float) -> engine.Settings:
    return engine.Settings(groups=2, steps=steps, step_seconds=step_seconds, deadline_s=150.0)


def program_args(s: engine.Settings) -> tuple[str, ...]:
    return ("--steps", str(s.steps), "--step-seconds", str(s.step_seconds), "--seed", str(s.seed),
            "--lr", str(s.lr), "--hidden", str(s.hidden), "--timeout", str(s.timeout_s),
            "--linger", str(s.deadline_s))


def group_env(group: int, s: engine.Settings, lighthouse: str, folder: Path) -> dict[str, str]:
    return {"REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(s.groups),
            "TORCHFT_LIGHTHOUSE": lighthouse, "FT_ROWS": str(folder),
            "PROGRAM": str(programs.path_of(engine.PROGRAM)), "OMP_NUM_THREADS": "1",
            "RUST_LOG": "error"}


def read_rows(folder: Path) -> list[dict]:
    """Every allocation's rows, each allocation's incarnations numbered after the last's."""
    rows = []
    for alloc in sorted(folder.glob("allocation*")):
        for row in engine.read_rows(alloc):
            row["incarnation"] += int(alloc.name.removeprefix("allocation")) * ALLOCATION
            rows.append(row)
    return sorted(rows, key=lambda r: r["time"])


def first(rows: list[dict], event: str, group: int, since: float, committed: bool = False) -> float:
    """The time of ``group``'s first ``event`` row after ``since`` (a committed one for steps)."""
    found = [r["time"] for r in rows if r["event"] == event and r["group"] == group
             and r["time"] > since and (r.get("committed") or not committed)]
    if not found:
        raise RuntimeError(f"group {group}: no {event} row after {since:.1f}")
    return min(found)


def left_running(folder: Path) -> list[int]:
    """The pids whose command line names the run's folder (none once every job has ended)."""
    mark = str(folder).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if mark in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def submit_groups(slurm: Slurm, s: engine.Settings, lighthouse: str, folder: Path) -> list[str]:
    return [jobs.submit(slurm, [f"--job-name=ft-group{g}", f"--exclude={slurm.nodes[0].name}"],
                        GROUP_RECIPE, program_args(s), cwd=folder,
                        env=group_env(g, s, lighthouse, folder)) for g in range(s.groups)]


def group_lost(slurm: Slurm, folder: Path, steps: int = 400, step_seconds: float = 0.3,
               lose_after: int = 10, timeout: float = 300.0) -> FtRun:
    """The run: the last group's node lost once it has committed ``lose_after`` steps."""
    if len(slurm.nodes) < NODES:
        raise ValueError(f"a torchft run on Slurm needs {NODES} nodes, not {len(slurm.nodes)}")
    s = settings(steps, step_seconds)
    lighthouse_node = slurm.nodes[0]
    lighthouse = f"http://{lighthouse_node.name}:{LIGHTHOUSE_PORT}"
    times: dict[str, float] = {"start": time.time()}
    beacon = jobs.submit(slurm, [f"--nodelist={lighthouse_node.name}"], LIGHTHOUSE_RECIPE,
                         cwd=folder, env={"LIGHTHOUSE_PORT": str(LIGHTHOUSE_PORT)})
    group_jobs: list[str] = []
    try:
        jobs.wait_for(slurm, beacon, lambda f: f.get("JobState") == "RUNNING", timeout, "running")
        group_jobs = submit_groups(slurm, s, lighthouse, folder)
        lost = s.groups - 1
        on = jobs.wait_for(slurm, group_jobs[lost], lambda f: f.get("JobState") == "RUNNING",
                           timeout, "running")
        times["running"] = time.time()
        [name] = expand(slurm, on["NodeList"])
        node = next(n for n in slurm.nodes if n.name == name)
        deadline = time.monotonic() + timeout
        while not any(r["event"] == "step" and r["group"] == lost and r["committed"]
                      and r["step"] >= lose_after for r in read_rows(folder)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {lost}: not {lose_after} steps after {timeout:g} s")
            time.sleep(0.2)
        times["lost"] = time.time()
        slurm.lose_node(node)
        slurm.wait_for_states({node.name: "down"}, timeout)
        times["down"] = time.time()
        jobs.wait_for(slurm, group_jobs[lost], lambda f: f.get("JobState") == "RUNNING"
                      and f.get("Restarts") == "1", timeout, "running again")
        times["running_again"] = time.time()
        fields = [jobs.wait_done(slurm, j, timeout) for j in group_jobs]
    finally:  # the lighthouse once the groups have ended; every job when the run failed
        slurm.run(["scancel", beacon, *group_jobs], 20)
    jobs.wait_done(slurm, beacon, 60)
    rows = read_rows(folder)
    times["first_started"] = first(rows, "started", lost, times["start"])
    times["first_committed"] = first(rows, "step", lost, times["first_started"], committed=True)
    times["started_again"] = first(rows, "started", lost, times["lost"])
    times["healed"] = first(rows, "healed", lost, times["started_again"])
    times["committed_again"] = first(rows, "step", lost, times["healed"], committed=True)
    failure = {"time": times["lost"], "what": f"{node.name} lost (link cut, slurmd killed)",
               "groups": [lost]}
    report = engine.assemble(s, rows, failures=[failure], start=times["start"],
                             left_running=left_running(folder), jobs=group_jobs,
                             lighthouse_job=beacon)
    report["checks"] = checks.checks(report, programs.load(engine.PROGRAM), STALL_BOUND_S)
    return FtRun(report, fields, times)
