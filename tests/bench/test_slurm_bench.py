"""The Slurm suite's prediction: how slurmctld pings its nodes, the requeue delay, and the
start (and heal) times measured on another job."""

from __future__ import annotations

import pytest

from ddpguide.bench.slurm import predicted_detect, predicted_requeue
from ddpguide.slurm.config import CRED_EXPIRE, KILL_WAIT, SCHED_INTERVAL


def test_detection_counts_the_failed_ping_cycles_before_the_one_that_marks_the_node_down():
    # this cluster: a cycle each second, a ping to a cut link failing after 3 connects of 2 s
    # (6 s, +0.5 s to the loop's next second); 2 cycles; the first ping 1 s after the loss
    assert predicted_detect(5, 5, 2) == pytest.approx(1.0 + 2 * 6.5)
    # Slurm's defaults (300, 10, 2): cycles 100 s apart, 6 connects (12 s) each; 3 cycles
    assert predicted_detect(300, 10, 2) == pytest.approx(50.5 + 3 * 100)
    # a longer SlurmdTimeout needs more failed cycles
    assert predicted_detect(30, 5, 2) == pytest.approx(5.5 + 3 * 10)


def test_the_prediction_adds_detection_requeue_start_and_heal():
    parts = predicted_requeue(start=7.0, heal=3.0)
    assert parts["requeue"] == CRED_EXPIRE + 1 + SCHED_INTERVAL / 2
    assert parts["total"] == pytest.approx(predicted_detect() + CRED_EXPIRE + 1
                                           + SCHED_INTERVAL / 2 + 10.0)
    assert "heal" not in predicted_requeue(start=7.0)
    # a whole job's ranks left on the other nodes end at Slurm's SIGKILL, KillWait s on
    assert (predicted_requeue(start=7.0, survivors=True)["requeue"]
            == KILL_WAIT + CRED_EXPIRE + 1 + SCHED_INTERVAL / 2)


def test_the_suite_is_listed():
    from ddpguide.bench import SUITES

    assert "chapter 18" in SUITES["slurm"]
