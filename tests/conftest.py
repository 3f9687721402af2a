"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import pytest

from process_guard import guard


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test whose child processes are still alive 5 s after it ends."""
    yield from guard()
