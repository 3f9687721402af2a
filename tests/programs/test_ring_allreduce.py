"""ring_allreduce.py: the hand-written ring sums like dist.all_reduce."""

from __future__ import annotations

import json
import re

import pytest

from tests.programs.programs_support import PYTHON, check_ok, copy_program, parse_error, run
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused


@pytest.mark.timeout(150)
def test_the_ring_matches_all_reduce_on_three_ranks(tmp_path):
    copy_program("ring_allreduce.py", tmp_path)
    result = check_ok(run([PYTHON, "ring_allreduce.py", "--report", "report.json"], tmp_path, timeout=120))
    assert "3 ranks" in result.stdout and "1000003 float32 values each" in result.stdout
    difference = float(re.search(r"max \|ring - dist.all_reduce\| = (\S+)", result.stdout).group(1))
    # float32 sums of 3 values added in another order: a few units in the last place
    assert difference < 1e-5
    assert re.search(r"median time: ring [\d.]+ ms, dist.all_reduce [\d.]+ ms", result.stdout)
    report = assert_report_agrees((json.loads((tmp_path / "report.json").read_text()), result.stdout.splitlines()))
    assert (report["world_size"], report["numel"]) == (3, 1000003)
    assert f"{report['max_difference']:.3g}" == f"{difference:.3g}"
    assert (f"median time: ring {report['ring_ms']:.2f} ms, dist.all_reduce {report['all_reduce_ms']:.2f} ms"
            in result.stdout)


def test_a_report_into_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    copy_program("ring_allreduce.py", tmp_path)
    assert_report_into_missing_folder_refused("ring_allreduce.py", tmp_path, {},
                                              "ring_allreduce.py: error: --report missing/r.json: no folder ")


@pytest.mark.parametrize("args, message", [
    (["--world-size", "1"], "argument --world-size: a ring needs at least 2 ranks, got 1"),
    (["--world-size", "3", "--numel", "2"],
     "argument --numel: expected at least one value per rank (3), got 2"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, args, message):
    path = copy_program("ring_allreduce.py", tmp_path)
    stderr = parse_error(path, args, monkeypatch, capsys)
    assert stderr == f"ring_allreduce.py: error: {message}\n"
