"""The Slurm suite's prediction: the configuration's timeouts plus the preempted job's times."""

from __future__ import annotations

import pytest

from ddpguide.bench.slurm import predicted_requeue
from ddpguide.slurm.config import CRED_EXPIRE, SLURMD_TIMEOUT


def test_the_prediction_adds_detection_eligibility_scheduling_and_start():
    parts = predicted_requeue(sched=2.0, start=7.0)
    assert parts["detect"] == pytest.approx(SLURMD_TIMEOUT * 7 / 6)
    assert parts["eligible"] == CRED_EXPIRE + 1
    assert parts["total"] == pytest.approx(SLURMD_TIMEOUT * 7 / 6 + CRED_EXPIRE + 1 + 9.0)


def test_the_suite_is_listed():
    from ddpguide.bench import SUITES

    assert "chapter 18" in SUITES["slurm"]
