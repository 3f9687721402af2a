"""``python -m ddpguide.bench SUITE`` and ``python -m ddpguide.bench.pipeline``: inputs first.

A suite can run for many minutes; a report that cannot be written, an unknown
suite or a bad number must fail before it starts: one line naming the option
and the value, exit status 2, no suite run, nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ddpguide.bench import SUITES
from ddpguide.bench import __main__ as bench_main
from ddpguide.bench import pipeline as bench_pipeline
from ddpguide.bench.report import Report
from ddpguide.launch.torchrun import agent_environment
from tests.file_snapshot import snapshot

PROG = "python -m ddpguide.bench"
PIPELINE = "python -m ddpguide.bench.pipeline"
NOT_A_REPORT = "exists and is not a benchmark report; refusing to overwrite it"


@pytest.fixture
def place(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x\n")
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "old.json").write_text(json.dumps(Report("ddp", machine={}).to_dict()))
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


@pytest.fixture
def no_suite_runs(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a benchmark started despite bad input")
    monkeypatch.setattr(bench_main, "load_suite", started)
    monkeypatch.setattr(bench_pipeline, "run", started)


PROVENANCE = ("measured_at", "command", "load_at_start", "load_at_end")


def _bench_cases(t):
    choices = ", ".join([*SUITES, "all"])
    return [
        ([], "the following arguments are required: SUITE"),
        (["nope"], f"argument SUITE: invalid choice: 'nope' (choose from {choices})"),
        (["ddp", "--repeats", "3"], "unrecognized arguments: --repeats 3"),
        (["ddp", "--json", f"{t}/a_dir"], f"argument --json: {t}/a_dir is a directory"),
        (["ddp", "--json", f"{t}/fifo"], f"argument --json: {t}/fifo is not a regular file"),
        (["ddp", "--json", f"{t}/a_file/r.json"], f"argument --json: {t}/a_file is not a directory"),
        (["ddp", "--json", f"{t}/notes.txt"], f"argument --json: {t}/notes.txt {NOT_A_REPORT}"),
        (["ddp", "--json", ""], "argument --json: empty file name"),
    ]


def _pipeline_cases(t):
    return [
        (["--image-size", "16"], "argument --image-size: must be >= 32, got 16"),
        (["--image-size", "big"], "argument --image-size: expected an integer, got 'big'"),
        (["--batch", "0"], "argument --batch: must be >= 1, got 0"),
        (["--batch", "7"], "argument --batch: batch 7 has no micro-batch size of 8 or more that "
                           "divides it"),
        (["--batch", "17"], "argument --batch: batch 17 has no micro-batch size of 8 or more "
                            "that divides it"),
        (["--plot", f"{t}/plot.xyz"], f"argument --plot: {t}/plot.xyz: unknown image format "
                                      "'xyz' (use .png, .pdf or .svg)"),
        (["--plot", f"{t}/plot"], f"argument --plot: {t}/plot: unknown image format '' "
                                  "(use .png, .pdf or .svg)"),
        (["--plot", f"{t}/a_dir"], f"argument --plot: {t}/a_dir is a directory"),
        (["--plot", f"{t}/a_file/p.png"], f"argument --plot: {t}/a_file is not a directory"),
        (["--json", f"{t}/notes.txt"], f"argument --json: {t}/notes.txt {NOT_A_REPORT}"),
        (["--json", f"{t}/p.png", "--plot", f"{t}/p.png"],
         f"argument --json: {t}/p.png is the plot (--plot)"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_nothing_runs(place, no_suite_runs, capsys):
    for prog, main, cases in ((PROG, bench_main.main, _bench_cases(place)),
                              (PIPELINE, bench_pipeline.main, _pipeline_cases(place))):
        for argv, message in cases:
            before = snapshot(place)
            with pytest.raises(SystemExit) as info:
                main(argv)
            out, err = capsys.readouterr()
            assert (info.value.code, out) == (2, ""), argv
            assert err == f"{prog}: error: {message} (see --help)\n", argv
            assert snapshot(place) == before, argv


def test_an_unwritable_report_is_refused_before_the_suite(no_suite_runs, capsys, unwritable_directory):
    directory, reason = unwritable_directory
    for main, argv in ((bench_main.main, ["amp", "--json", f"{directory}/r.json"]),
                       (bench_pipeline.main, ["--json", f"{directory}/r.json"])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err.endswith(
            f"error: argument --json: cannot write in {directory} ({reason}) (see --help)\n")


class _FakeSuite:
    """A suite that measures nothing, to follow the report to the file."""

    @staticmethod
    def run(quick: bool) -> Report:
        report = Report("fake", machine={"cpu_count": 2})
        report.add("step", 1.5, "ms")
        report.ratios["speedup"] = 2.0
        return report


def test_a_good_run_writes_its_report_and_may_replace_an_earlier_one(place, monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "load_suite", lambda name: _FakeSuite)
    for target in (place / "old.json", place / "new" / "deeper" / "r.json"):
        assert bench_main.main(["ddp", "--quick", "--json", str(target)]) == 0
        written = json.loads(target.read_text())
        assert {k: written.pop(k) is not None for k in PROVENANCE} == dict.fromkeys(PROVENANCE, True)
        assert written == {
            "suite": "fake", "machine": {"cpu_count": 2},
            "measurements": [{"name": "step", "value": 1.5, "unit": "ms", "details": {}}],
            "ratios": {"speedup": 2.0}, "spreads": {}, "notes": []}
    assert "suite: fake" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_the_real_entry_point_refuses_an_unknown_suite_in_one_line(place):
    before = snapshot(place)
    done = subprocess.run([sys.executable, "-m", "ddpguide.bench", "nope", "--json", "r.json"],
                          cwd=place, env=agent_environment(), capture_output=True, text=True,
                          timeout=100)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"{PROG}: error: argument SUITE: invalid choice: 'nope' (choose from "
                           f"{', '.join([*SUITES, 'all'])}) (see --help)\n")
    assert snapshot(place) == before
