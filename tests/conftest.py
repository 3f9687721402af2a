"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import os

import pytest
from tests.process_guard import guard


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test whose child processes are still alive 5 s after it ends."""
    yield from guard()


@pytest.fixture(scope="module")
def spawned(request):
    """``spawned(world)``: every rank's results of the test module's ``_calls(world)``.

    The calls run one after another in one process group per world size, started
    once for the module (a start costs seconds), through ``run_several``.
    """
    from ddpguide.launch.spawn import run_several, spawn

    cache: dict[int, list[dict]] = {}

    def results(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = spawn(run_several, world, request.module._calls(world),
                                 timeout=240, echo=False)
        return cache[world]

    return results


@pytest.fixture
def unwritable_directory() -> tuple[str, str]:
    """A directory nobody may create files in, root included (``/sys``), and the reason
    the kernel gives; the test is skipped where it is writable."""
    directory = "/sys"
    try:
        os.close(os.open(f"{directory}/ddpguide-probe", os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as exc:
        return directory, exc.strerror
    pytest.skip(f"{directory} is writable here")
