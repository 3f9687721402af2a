"""The stall bound the survivors are held to."""

from __future__ import annotations

from ddpguide.failures import engine, run


def test_the_stall_bound_is_five_timeouts_heartbeat_join_and_ten_steps():
    settings = engine.Settings(timeout_s=5, heartbeat_timeout_ms=1000, join_timeout_ms=500,
                               step_seconds=0.1)
    assert run.stall_bound_s(settings) == 5 * 5 + 1.5 + 1.0 + 2.0
