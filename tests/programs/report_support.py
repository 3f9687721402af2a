"""The report a program writes with ``--report FILE`` against the check lines it prints."""

from __future__ import annotations

import sys
from pathlib import Path

from ddpguide.launch.programs import ProgramRun


def printed_checks(lines: list[str]) -> list[tuple[str, bool]]:
    """(line, passed) for each check line: ``check: ...: OK`` (or ``FAILED``), or
    ``check passed: ...`` (``check FAILED: ...``); whitespace runs made one space."""
    found = []
    for line in lines:
        line = " ".join(line.split())
        if line.startswith(("check passed", "check FAILED")):
            found.append((line, line.startswith("check passed")))
        elif line.startswith("check:") and line.endswith((": OK", ": FAILED")):
            found.append((line, line.endswith(": OK")))
    return found


def assert_report_agrees(launch: ProgramRun | tuple[dict, list[str]]) -> dict:
    """The report has one check for each check line the program printed, in order, with the
    same verdict, and each line names its check; return the report. ``launch``: a run of
    ``programs.run(..., report=True)``, or (report, the lines the program printed)."""
    if isinstance(launch, ProgramRun):
        assert launch.report is not None, launch.text()
        report, lines = launch.report, launch.program_lines()
    else:
        report, lines = launch
    printed = printed_checks(lines)
    reported = report["checks"]
    assert len(printed) == len(reported), (printed, reported)
    for (line, passed), check in zip(printed, reported):
        assert check["name"] in line, (check["name"], line)
        assert check["ok"] is passed, (check, line)
    return report


def assert_report_into_missing_folder_refused(program: str, folder: Path, env: dict[str, str],
                                              message_start: str, *args: str) -> None:
    """``python PROGRAM ... --report missing/r.json``: one line on stderr, exit status 2, nothing
    written. Through the suite's runner (``programs_support.run``: forked warm once the program
    has run as typed in this process)."""
    from tests.programs.programs_support import run

    before = sorted(p.name for p in folder.iterdir())
    done = run([sys.executable, program, *args, "--report", "missing/r.json"], folder, timeout=150, env=env)
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message_start), done.stderr
    assert "missing" in done.stderr, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written
