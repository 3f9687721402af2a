r"""Slurm on the emulated cluster (chapter 18): the time from a lost node to training resumed.

On a 3-node Slurm, two jobs of ``slurm_requeue.py`` (2 nodes each, ``--requeue``):

1. a preempted job (the batch script's USR1 trap requeues it): from it, ``start``, the time
   from the job running again to training going on (torchrun, the rendezvous, the
   checkpoint loaded);
2. a job that loses node 1 after its first epoch: measured, the time from the loss to the
   node DOWN, from DOWN to the job running again, and from then to the first step of the
   next allocation.

Then, on a 4-node Slurm, torchft (``slurm.ft``): the lighthouse one job, each replica group of
``ft_train.py`` its own job; the last group's node is lost and that group's job is requeued
on the spare node. Measured: loss to DOWN, DOWN to running again, running to the group's
first row (``started``), and from it to its first committed step after the heal.

Predicted, from the configuration and how slurmctld (22.05) pings its nodes, never from the
run predicted. The controller's background loop wakes every second and starts a ping cycle
every ``P = SlurmdTimeout // 3`` s (integer division: 1 s here) once the last cycle has ended;
a node that answered within the last ``P`` s (by the clock's whole seconds) is skipped, so a
live node is pinged every ``P + 1`` s. A cycle marks DOWN a node whose last answer is no
later than the *previous* cycle's start minus ``SlurmdTimeout``. A ping to a node whose link
is cut ends only when its connects have failed: one try of ``TCPTimeout`` s, then another
while fewer than ``min(MessageTimeout, 10)`` s have been counted, ``k = min(M, 10) // T + 1``
tries, ``D = k * T`` s (6 s here). So, with ``S`` = SlurmdTimeout, ``M`` = MessageTimeout,
``T`` = TCPTimeout:

    detect   = (P + 1) / 2  +  n * C,   C = max(P, D + 1/2),   n = 1 + ceil((S - (P + 1)) / C)

(the first ping after the loss comes on average (P + 1) / 2 s later, its last answer ``P + 1``
s before that ping; the next cycle starts ``P`` s after the last or, when that one lasted
longer, at the loop's next second after it ended: ``C`` s apart;
``n`` cycles until one starts ``S`` s after that answer, then one more that marks it DOWN:
14.0 s here). The node DOWN, Slurm ends the job: its processes on the nodes left get SIGTERM,
and SIGKILL ``KillWait`` s later; the whole job's ranks there are stuck in a collective with
the lost node and end only then (a torchft group's job ran on the lost node alone: nothing to
wait for). Once it has ended, the job is requeued and eligible ``cred_expire + 1`` s later
(slurm.conf(5), ``AuthInfo``); the scheduler's next pass (every ``SCHED_INTERVAL`` s,
``bf_interval``/``sched_interval``) starts it, on average half an interval later:

    requeue  = [KillWait] + cred_expire + 1 + SCHED_INTERVAL / 2

then ``start`` as measured on the preempted job. For torchft's group, ``start`` and ``heal``
are measured on the same group's first allocation of the same run: its job running to its
``started`` row, and from that row to its first committed step (joining a quorum and one step;
in the requeued allocation, the heal from a peer is in that span too). Each part's measured over
predicted is reported; ``requeue_measured_over_predicted`` and
``ft_requeue_measured_over_predicted`` are the totals' (goal 0.8-1.25).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from ddpguide.bench.report import Report
from ddpguide.cluster import Spec
from ddpguide.slurm import ft, runs, up
from ddpguide.slurm.config import (
    CRED_EXPIRE,
    KILL_WAIT,
    MESSAGE_TIMEOUT,
    SCHED_INTERVAL,
    SLURMD_TIMEOUT,
    TCP_TIMEOUT,
)

#: the appendix's anchors (ddpguide.bench.appendix): meaning, reference, goal
ANCHORS: dict[str, tuple[str, str, str]] = {
    "requeue_measured_over_predicted": (
        "whole job (slurm_requeue.py, 2 nodes): node lost -> training resumed, measured / "
        "predicted (ping cycles + KillWait + cred_expire + scheduler pass + start of the "
        "preempted job)",
        "", "0.8-1.25"),
    "ft_requeue_measured_over_predicted": (
        "one torchft group's job (ft_train.py): node lost -> the group committing again, "
        "measured / predicted (the same + start and first step of its first allocation)",
        "", "0.8-1.25"),
}


def predicted_detect(slurmd_timeout: int = SLURMD_TIMEOUT, message_timeout: int = MESSAGE_TIMEOUT,
                     tcp_timeout: int = TCP_TIMEOUT) -> float:
    """Seconds from a node's link cut to slurmctld marking it DOWN, on average."""
    ping = slurmd_timeout // 3
    failed_ping = (min(message_timeout, 10) // tcp_timeout + 1) * tcp_timeout
    cycle = max(ping, failed_ping + 0.5)  # the next cycle once the interval and the last have ended
    cycles = 1 + math.ceil(max(0, slurmd_timeout - (ping + 1)) / cycle)
    return (ping + 1) / 2 + cycles * cycle


def predicted_requeue(start: float, heal: float = 0.0, survivors: bool = False) -> dict[str, float]:
    """The parts of the time from a lost node to training resumed, and their sum.
    ``survivors``: the job has processes on nodes that remain, stuck in a collective with
    the lost node until Slurm's SIGKILL, ``KillWait`` s after its SIGTERM."""
    parts = {"detect": predicted_detect(),
             "requeue": (KILL_WAIT if survivors else 0) + CRED_EXPIRE + 1.0 + SCHED_INTERVAL / 2,
             "start": start}
    if heal:
        parts["heal"] = heal
    return {**parts, "total": sum(parts.values())}


def compare(report: Report, name: str, measured: dict[str, float], predicted: dict[str, float]) -> None:
    """Each part and the total, measured against predicted."""
    for part, value in measured.items():
        report.add(f"{name}_{part}", value, "s", predicted=predicted[part],
                   measured_over_predicted=value / predicted[part])


def run(quick: bool = False) -> Report:
    report = Report("slurm")
    epochs = 2 if quick else 3
    with tempfile.TemporaryDirectory(prefix="ddpguide-bench-slurm-") as folder:
        with up(Spec(nodes=3)) as slurm:
            (Path(folder) / "preempted").mkdir()
            (Path(folder) / "lost").mkdir()
            pre = runs.preempted(slurm, Path(folder) / "preempted", epochs)
            lost = runs.lost_node(slurm, Path(folder) / "lost", lose=1, epochs=epochs)
        with up(Spec(nodes=ft.NODES)) as slurm:
            (Path(folder) / "ft").mkdir()
            group = ft.group_lost(slurm, Path(folder) / "ft")
    start = pre.report["history"][1]["started_at"] - pre.times["running_again"]  # type: ignore[index]
    resumed = lost.report["history"][1]["started_at"]  # type: ignore[index]
    t = lost.times
    measured = {"detect": t["down"] - t["lost"], "requeue": t["running_again"] - t["down"],
                "start": resumed - t["running_again"], "total": resumed - t["lost"]}
    predicted = predicted_requeue(start, survivors=True)
    compare(report, "lost_node", measured, predicted)
    report.add("preempted_requeue_to_running", pre.times["running_again"] - pre.times["signalled"], "s")
    g = group.times
    ft_measured = {"detect": g["down"] - g["lost"], "requeue": g["running_again"] - g["down"],
                   "start": g["started_again"] - g["running_again"],
                   "heal": g["committed_again"] - g["started_again"],
                   "total": g["committed_again"] - g["lost"]}
    ft_predicted = predicted_requeue(g["first_started"] - g["running"],
                                     g["first_committed"] - g["first_started"])
    compare(report, "ft_group", ft_measured, ft_predicted)
    report.add("ft_group_started_to_healed", g["healed"] - g["started_again"], "s")
    failed = [c["name"] for c in group.report["checks"] if not c["ok"]]
    report.add("ft_invariants_failed", len(failed), "checks", failed=failed)
    report.ratios["requeue_measured_over_predicted"] = measured["total"] / predicted["total"]
    report.ratios["ft_requeue_measured_over_predicted"] = ft_measured["total"] / ft_predicted["total"]
    report.notes.append(
        f"SlurmdTimeout={SLURMD_TIMEOUT}s, MessageTimeout={MESSAGE_TIMEOUT}s, "
        f"TCPTimeout={TCP_TIMEOUT}s, cred_expire={CRED_EXPIRE}s, scheduler passes every "
        f"{SCHED_INTERVAL}s; whole job: slurm_requeue.py on 2 of 3 nodes x 1 rank, {epochs} "
        "epochs, start from the preempted job; torchft: 2 groups of ft_train.py x 1 rank on 4 "
        "nodes, start and heal from the lost group's first allocation. Never the predicted run's.")
    return report
