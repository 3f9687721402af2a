"""Chapter 18's runs: the failures Slurm handles, each run on a live cluster and read back.

* :func:`reference`: ``slurm_requeue.py`` never stopped, under ``torchrun`` on this
  machine, the same world size: the model every interrupted run must end with;
* :func:`preempted`: the job told to stop (``scancel --batch --signal=USR1``: the batch
  script's trap requeues it), checkpointing on SIGTERM and finishing in a later allocation;
* :func:`lost_node`: a node lost mid-job (its link cut, every process on it killed), the
  node DOWN, the job requeued on the nodes left and resumed from its last checkpoint;
* :func:`bad_input`: a job submitted with ``--requeue`` whose program refuses its input
  fails once and is not requeued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpguide.launch import programs
from ddpguide.launch import report as reports
from ddpguide.slurm import jobs
from ddpguide.slurm.scheduler import Slurm

PROGRAM = "slurm_requeue.py"
OUTPUT = "job.out"
#: the recipe's job: --requeue, every allocation's output appended to one file
OPTIONS = ["--requeue", "--open-mode=append", f"--output={OUTPUT}"]


@dataclass
class JobRun:
    """One job's end: its report, its fields at the end, and times (wall clock) of its events."""

    job: str
    report: dict | None
    fields: dict[str, str]
    output: str
    times: dict[str, float] = field(default_factory=dict)


def program_args(epochs: int, step_seconds: float) -> tuple[str, ...]:
    return ("--epochs", str(epochs), "--step-seconds", str(step_seconds), "--report", "report.json")


def reference(epochs: int, folder: Path) -> dict:
    """The report of a run that was never stopped: 2 workers on this machine."""
    done = programs.run(PROGRAM, "--epochs", str(epochs), launcher=programs.torchrun(2),
                        workdir=folder, report=True, echo=False, timeout=180)
    return done.reported()


def finish(slurm: Slurm, job: str, folder: Path, timeout: float, times: dict[str, float]) -> JobRun:
    fields = jobs.wait_done(slurm, job, timeout)
    times["finished"] = time.time()
    found = reports.read(folder / "report.json", f"job {job}") if (folder / "report.json").exists() else None
    return JobRun(job, found, fields, (folder / OUTPUT).read_text(errors="replace"), times)


def preempted(slurm: Slurm, folder: Path, epochs: int = 3, step_seconds: float = 0.05,
              timeout: float = 240) -> JobRun:
    """The job warned mid-epoch as before a preemption: its batch script requeues it."""
    job = jobs.submit(slurm, OPTIONS, args=program_args(epochs, step_seconds), cwd=folder,
                      program=programs.path_of(PROGRAM))
    jobs.appears(folder / OUTPUT, "rank 0: epoch 0 done", timeout)
    time.sleep(5 * step_seconds)  # a few steps into epoch 1
    times = {"signalled": time.time()}
    done = slurm.run(["scancel", "--batch", "--signal=USR1", job], 20)
    if done.returncode != 0:
        raise RuntimeError(f"scancel: {done.errors.strip()}")
    jobs.wait_for(slurm, job, lambda f: f.get("JobState") == "RUNNING" and f.get("Restarts") == "1",
                  timeout, "running again")
    times["running_again"] = time.time()
    return finish(slurm, job, folder, timeout, times)


def lost_node(slurm: Slurm, folder: Path, lose: int = 1, epochs: int = 3, step_seconds: float = 0.05,
              timeout: float = 300) -> JobRun:
    """Node ``lose`` lost after the job's first epoch: the job resumes on the nodes left."""
    job = jobs.submit(slurm, ["--nodes=2", *OPTIONS], args=program_args(epochs, step_seconds),
                      cwd=folder,
                      program=programs.path_of(PROGRAM))
    node = slurm.cluster.node(lose)
    jobs.wait_for(slurm, job, lambda f: node.name in expand(slurm, f.get("NodeList", "")), timeout,
                  f"running on {node.name}")
    jobs.appears(folder / OUTPUT, "rank 0: epoch 0 done", timeout)
    time.sleep(5 * step_seconds)
    times = {"lost": time.time()}
    slurm.lose_node(node)
    slurm.wait_for_states({node.name: "down"}, timeout)
    times["down"] = time.time()
    jobs.wait_for(slurm, job, lambda f: f.get("JobState") == "RUNNING" and f.get("Restarts") == "1",
                  timeout, "running again")
    times["running_again"] = time.time()
    return finish(slurm, job, folder, timeout, times)


def bad_input(slurm: Slurm, folder: Path, timeout: float = 120) -> JobRun:
    """``--epochs 0``: every worker exits 2 before training; the job fails and stays failed."""
    job = jobs.submit(slurm, OPTIONS, args=("--epochs", "0"), cwd=folder,
                      program=programs.path_of(PROGRAM))
    return finish(slurm, job, folder, timeout, {})


def expand(slurm: Slurm, nodelist: str) -> list[str]:
    """``node[0-1]`` as ``['node0', 'node1']`` (``scontrol show hostnames``)."""
    if not nodelist or nodelist == "(null)":
        return []
    done = slurm.run(["scontrol", "show", "hostnames", nodelist], 20)
    return done.output.split()
