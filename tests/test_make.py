"""``make test-notebooks`` executes every chapter exactly once.

Most chapters run two at a time; the ones in the Makefile's ``ALONE_CHAPTERS`` (their
outputs show times measured as they run) run after them, one at a time. The commands are
read from ``make -n``, so a chapter added, renamed or listed twice shows here, before the
chapters take their minutes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def notebook_commands(*variables: str) -> list[list[str]]:
    """The pytest commands of ``make test-notebooks`` (not run: ``make -n``), as argument lists."""
    # under `make test NB_OVERWRITE=1` the outer make passes its variables down (MAKEFLAGS,
    # and NB_OVERWRITE itself in the environment: ``variables`` set it on the command line)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")}
    printed = subprocess.run(["make", "-n", "--no-print-directory", "test-notebooks", *variables],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=30).stdout
    commands = [shlex.split(line) for line in printed.replace("\\\n", " ").splitlines()]
    return [c for c in commands if c[1:4] == ["-m", "pytest", "--nbmake"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("variables,folder", [(("NB_OVERWRITE=",), "_executed/book"),
                                              (("NB_OVERWRITE=1",), "./book")])
def test_every_chapter_runs_once_and_those_that_measure_time_alone(variables, folder):
    chapters = {f"{folder}/{p.name}" for p in (ROOT / "book").glob("*.ipynb")}
    together, alone = notebook_commands(*variables)
    ignored = {a.removeprefix("--ignore=") for a in together if a.startswith("--ignore=")}
    assert together[-1] == folder and together[together.index("-n") + 1] == "2"
    listed = [a for a in alone if a.endswith(".ipynb")]
    assert "-n" not in alone
    assert sorted(listed) == sorted(ignored) and len(set(listed)) == len(listed)
    assert set(listed) <= chapters, set(listed) - chapters
    names = {Path(a).stem for a in listed}
    assert names == {"02_collectives", "07_amp", "15_cluster", "16_plan", "17_failures"}
