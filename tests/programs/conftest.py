"""Fixtures shared by the programs' tests: one default run of ddp_spawn.py per session."""

from __future__ import annotations

import pytest

from ddpguide.launch import report as reports
from tests.programs.programs_support import PYTHON, check_ok, copy_program, run


@pytest.fixture(scope="session")
def spawn_default_run(tmp_path_factory):
    """``python ddp_spawn.py --report out.json`` in an empty folder (its Run: line, reporting):
    (folder, result, report)."""
    folder = tmp_path_factory.mktemp("ddp_spawn")
    copy_program("ddp_spawn.py", folder)
    result = check_ok(run([PYTHON, "ddp_spawn.py", "--report", "out.json"], folder, timeout=150))
    return folder, result, reports.read(folder / "out.json", "ddp_spawn.py")
