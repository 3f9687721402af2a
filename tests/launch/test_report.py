"""The report channel: ``run(..., report=True)`` adds ``--report report.json`` to the command and
reads the file; a missing or malformed report is one clear error."""

from __future__ import annotations

import json

import pytest

from ddpguide.launch import programs
from ddpguide.launch.report import ReportError, failed, read, read_log

WRITES = ("import json, os, sys\n"
          "path = sys.argv[sys.argv.index('--report') + 1]\n"
          "print('check: sums agree: OK')\nprint('check: all equal: FAILED')\n"
          "with open(path + '.tmp', 'w') as f:\n"
          "    json.dump({'checks': [{'name': 'sums agree', 'ok': True},"
          " {'name': 'all equal', 'ok': False}], 'bytes': [8, 8]}, f)\n"
          "os.replace(path + '.tmp', path)\n"
          "sys.exit(int(sys.argv[1]))\n")


@pytest.fixture
def fake_programs(tmp_path, monkeypatch):
    folder = tmp_path / "programs"
    folder.mkdir()
    (folder / "writes.py").write_text(WRITES)
    (folder / "silent.py").write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    monkeypatch.setattr(programs, "PROGRAMS", folder)
    return folder


@pytest.mark.multiprocess
def test_the_command_names_the_report_and_the_run_carries_it(fake_programs):
    done = programs.run("writes.py", "0", echo=False, report=True)
    assert done.command == "python writes.py 0 --report report.json"
    assert done.report == {"checks": [{"name": "sums agree", "ok": True},
                                      {"name": "all equal", "ok": False}], "bytes": [8, 8]}
    assert failed(done.report) == ["all equal"]
    assert sorted(p.name for p in done.workdir.iterdir()) == ["report.json", "writes.py"]
    assert programs.run("silent.py", "0", echo=False).report is None  # not asked for


@pytest.mark.multiprocess
def test_a_report_is_required_after_success_and_read_if_there_after_failure(fake_programs, tmp_path):
    with pytest.raises(ReportError, match=r"^`python silent.py 0 --report report.json` wrote no report at "):
        programs.run("silent.py", "0", echo=False, report=True)
    assert programs.run("silent.py", "2", echo=False, expect=2, report=True).report is None
    assert failed(programs.run("writes.py", "1", echo=False, expect=1, report=True).report) == ["all equal"]


def test_a_run_without_a_report_says_so_in_one_line_when_its_report_is_asked_for(tmp_path):
    report = {"checks": [], "bytes": [8]}
    assert programs.ProgramRun("python writes.py 0", 0, "", 0.1, tmp_path, report).reported() is report
    failed_run = programs.ProgramRun("python silent.py 2 --report report.json", 2, "", 0.1, tmp_path)
    with pytest.raises(ReportError) as error:
        failed_run.reported()
    assert str(error.value) == "`python silent.py 2 --report report.json` (exit status 2): no report"


@pytest.mark.multiprocess
def test_a_report_left_by_an_earlier_run_in_the_folder_is_not_this_run_s(fake_programs, tmp_path):
    programs.run("writes.py", "0", echo=False, report=True, workdir=tmp_path / "run")
    with pytest.raises(ReportError, match="wrote no report"):
        programs.run("silent.py", "0", echo=False, report=True, workdir=tmp_path / "run")


@pytest.mark.parametrize("text, problem", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds a list, not an object"),
    ('{"bytes": 1}', "has no list of checks"),
    ('{"checks": [{"name": "a", "ok": "yes"}]}', "check 0 is not an object with a name and ok"),
    ('{"checks": [{"ok": true}]}', "check 0 is not an object with a name and ok"),
])
def test_a_malformed_report_is_one_line_that_says_what_is_wrong(tmp_path, text, problem):
    path = tmp_path / "report.json"
    path.write_text(text)
    with pytest.raises(ReportError) as error:
        read(path, "prog.py")
    assert str(error.value).startswith(f"prog.py: the report {path} {problem}")
    assert "\n" not in str(error.value)


def test_a_well_formed_report_is_read_as_written(tmp_path):
    report = {"checks": [{"name": "x", "ok": True, "worst": 1e-12}], "work": {"ring": [0.5, 1.5]}}
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert read(tmp_path / "r.json") == report


def test_a_live_log_is_read_line_by_line_as_it_grows(tmp_path):
    log = tmp_path / "epochs.jsonl"
    assert read_log(log) == []  # nothing logged yet
    log.write_text('{"epoch": 0}\n{"epoch": 1, "loss": 0.5}\n{"epoch": 2, "lo')
    assert read_log(log) == [{"epoch": 0}, {"epoch": 1, "loss": 0.5}]  # the third is being written
    with open(log, "a") as f:
        f.write('ss": 0.25}\n')
    assert read_log(log)[-1] == {"epoch": 2, "loss": 0.25}


def test_a_line_a_kill_cut_short_and_a_line_that_is_no_object_are_left_out(tmp_path):
    log = tmp_path / "rows.jsonl"
    # a killed rank's half line, continued by its restart's first line; a list; a blank line
    log.write_text('{"step": 1}\n{"step": 2, "lo{"step": 2, "incarnation": 1}\n[3]\n\n{"step": 3}\n')
    assert read_log(log) == [{"step": 1}, {"step": 3}]
