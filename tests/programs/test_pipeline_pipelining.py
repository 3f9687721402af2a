"""pipeline_pipelining.py: two GPipe stages give one process's loss and gradients."""

from __future__ import annotations

import re

import pytest

from tests.programs.programs_support import TORCHRUN, check_ok, copy_program, parse_error, run


@pytest.mark.timeout(150)
def test_two_stages_match_one_process(tmp_path):
    copy_program("pipeline_pipelining.py", tmp_path)
    result = check_ok(run([TORCHRUN, "--standalone", "--nproc-per-node=2",
                           "pipeline_pipelining.py"], tmp_path, timeout=120))
    out = result.stdout
    assert "pipeline matches one process within 1e-05: True" in out
    gaps = re.findall(r"\[rank (\d)\] step (\d): stage \1 gradients vs one process, "
                      r"max difference ([\d.e+-]+)", out)
    assert sorted((rank, step) for rank, step, _ in gaps) == [
        (rank, step) for rank in "01" for step in "012"]
    assert all(float(gap) < 1e-5 for _, _, gap in gaps)
    losses = re.findall(r"loss (\S+) vs (\S+)", out)
    assert len(losses) == 3 and all(a == b for a, b in losses)


@pytest.mark.parametrize("args, message", [
    (["--microbatches", "3"], "argument --microbatches: 3 does not divide --batch-size 64"),
    (["--steps", "0"], "argument --steps: expected a value > 0, got 0"),
    ([], "needs 2 ranks (WORLD_SIZE=None): start me with "
         "torchrun --standalone --nproc-per-node=2 pipeline_pipelining.py"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, args, message):
    path = copy_program("pipeline_pipelining.py", tmp_path)
    stderr = parse_error(path, args, monkeypatch, capsys)
    assert stderr == f"pipeline_pipelining.py: error: {message}\n"
