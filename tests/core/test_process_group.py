"""Joining and leaving the process group: idempotent, and with the timeout it is given."""

from __future__ import annotations

import pytest

from ddpguide.core.process_group import DEFAULT_TIMEOUT_S
from ddpguide.launch.spawn import spawn
from tests.core.group_workers import leave_and_rejoin

TIMEOUT_S = 2.0


@pytest.mark.timeout(150)
def test_setup_is_idempotent_cleanup_leaves_and_the_timeout_is_applied(tmp_path):
    results = spawn(leave_and_rejoin, 2, TIMEOUT_S, str(tmp_path / "done"), backend="gloo", threads_per_rank=1,
                    timeout=120, collective_timeout=DEFAULT_TIMEOUT_S, echo=False)
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["same_group"] and r["env"], "setup in an existing group only reports it"
        assert r["runtime"] == ("gloo", "cpu")
        assert r["left"] and r["left_again"]
        assert r["threads"] == 1
        assert r["sum"] == 3.0  # the group made through env:// works
    rank0 = results[0]
    assert rank0["error"] is not None and "timed out" in rank0["error"].lower(), rank0["error"]
    # The wait ends at the timeout given to setup, not at spawn's or the default 60 s.
    assert TIMEOUT_S * 0.9 <= rank0["waited"] < DEFAULT_TIMEOUT_S / 3, rank0["waited"]
