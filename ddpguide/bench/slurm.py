"""Slurm on the emulated cluster (chapter 18): the time from a lost node to training resumed.

On a 3-node Slurm, two jobs of ``slurm_requeue.py`` (2 nodes each, ``--requeue``):

1. a preempted job (the batch script's USR1 trap requeues it): from it, the time Slurm
   takes from a requeue to the job running again beyond the requeue delay (``sched``:
   the old allocation stopping, the scheduler's next pass), and the time from running
   again to training going on (``start``: torchrun, the rendezvous, the checkpoint loaded);
2. a job that loses node 1 after its first epoch: measured, the wall-clock time from the
   loss to the first step of the next allocation.

Predicted for the second from the configuration and the first job only: the controller
marks a node DOWN once it has not answered for ``SlurmdTimeout``, checked at each ping
(every ``SlurmdTimeout``/3 s: on average ``SlurmdTimeout``/6 late); a requeued job is
eligible ``cred_expire`` + 1 s later; then ``sched`` and ``start`` as measured on the
preempted job. ``requeue_measured_over_predicted`` is measured over predicted (goal
0.8-1.25).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ddpguide.bench.report import Report
from ddpguide.cluster import Spec
from ddpguide.slurm import runs, up
from ddpguide.slurm.config import CRED_EXPIRE, SLURMD_TIMEOUT


def predicted_requeue(sched: float, start: float) -> dict[str, float]:
    """The parts of the time from a lost node to training resumed, and their sum."""
    parts = {"detect": SLURMD_TIMEOUT + SLURMD_TIMEOUT / 6, "eligible": CRED_EXPIRE + 1.0,
             "sched": sched, "start": start}
    return {**parts, "total": sum(parts.values())}


def run(quick: bool = False) -> Report:
    report = Report("slurm")
    epochs = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="ddpguide-bench-slurm-") as folder, \
            up(Spec(nodes=3)) as slurm:
        (Path(folder) / "preempted").mkdir()
        (Path(folder) / "lost").mkdir()
        pre = runs.preempted(slurm, Path(folder) / "preempted", epochs)
        resumed = pre.report["history"][1]["started_at"]  # type: ignore[index]
        sched = pre.times["running_again"] - pre.times["signalled"] - (CRED_EXPIRE + 1.0)
        start = resumed - pre.times["running_again"]
        lost = runs.lost_node(slurm, Path(folder) / "lost", lose=1, epochs=epochs)
    measured = lost.report["history"][1]["started_at"] - lost.times["lost"]  # type: ignore[index]
    predicted = predicted_requeue(sched, start)
    report.add("preempted_requeue_to_running", pre.times["running_again"] - pre.times["signalled"], "s")
    report.add("preempted_running_to_training", start, "s")
    report.add("lost_node_to_down", lost.times["down"] - lost.times["lost"], "s",
               slurmd_timeout=SLURMD_TIMEOUT)
    report.add("lost_node_to_training_resumed", measured, "s", predicted=predicted)
    report.ratios["requeue_measured_over_predicted"] = measured / predicted["total"]
    report.notes.append(
        f"3 Slurm nodes in network namespaces, SlurmdTimeout={SLURMD_TIMEOUT}s, "
        f"cred_expire={CRED_EXPIRE}s; slurm_requeue.py on 2 nodes x 1 rank, {epochs} epochs; "
        "the prediction uses the preempted job's times, never the lost-node job's. "
        "ft_requeue_measured_over_predicted (torchft's groups as Slurm jobs) is not measured yet.")
    return report
