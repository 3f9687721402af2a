"""Chapter 14: a node of an FSDP x TP 2 x 2 job dies; the job goes on as TP 2 on the
two ranks left, from the latest checkpoint, and its record of losses is the
uninterrupted run's: no step lost, none repeated."""

from __future__ import annotations

import pytest

from ddpguide.gpt.layouts import check_options, launch
from ddpguide.gpt.recovery import lose_a_node


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_losing_a_node_resumes_on_fewer_ranks_with_every_step_once(tmp_path):
    steps = 8
    whole = launch((), 1, tmp_path / "whole", extra=check_options(steps=steps))
    recovery = lose_a_node(tmp_path / "job", steps=steps, kill_after=2)
    assert recovery.layout["tp"] == 2 and recovery.layout["dp_shard"] == 1  # 2 ranks now
    assert 2 <= recovery.first_step < steps  # resumed from a checkpoint, not from scratch
    assert recovery.first_step >= recovery.killed_after
    assert len(recovery.losses) == steps
    assert max(abs(a - b) for a, b in zip(recovery.losses, whole.losses)) <= 1e-10
