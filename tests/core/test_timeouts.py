"""``ddpguide.core.timeouts``: one default and one limit for a collective's timeout, used by every command."""

from __future__ import annotations

import inspect

import pytest

from ddpguide.core import process_group, timeouts
from ddpguide.elastic.settings import UsageError
from ddpguide.elastic.worker_args import WorkerArgs
from ddpguide.launch import spawn
from ddpguide.train import cli as train_cli


def test_every_command_takes_the_same_default_and_limit():
    assert (timeouts.DEFAULT_TIMEOUT_S, timeouts.MAX_TIMEOUT_S) == (60.0, 7 * 24 * 3600.0)
    assert inspect.signature(process_group.setup).parameters["timeout_s"].default == 60.0
    assert inspect.signature(spawn.spawn).parameters["collective_timeout"].default == 60.0
    action = {a.dest: a for a in train_cli.build_parser()._actions}["timeout"]
    assert action.default == 60.0
    with pytest.raises(Exception, match="must be <= 604800"):
        action.type(str(timeouts.MAX_TIMEOUT_S * 2))
    with pytest.raises(UsageError, match="at most 604800"):
        WorkerArgs(checkpoint="c", timeout=timeouts.MAX_TIMEOUT_S * 2).validate()
    assert WorkerArgs(checkpoint="c", timeout=timeouts.MAX_TIMEOUT_S).validate()
