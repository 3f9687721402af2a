"""plan_step.py run as a reader runs it, in a folder with the plan_cost.py it imports and nothing
else: --measure writes this machine's hardware, --hardware predicts from it (the same as the
module computes), bad input is one line, exit status 2, nothing written (Python's own
__pycache__ of the imported plan_cost.py aside)."""

from __future__ import annotations

import json

import pytest

from ddpguide.bench.plan import QUICK_REPEATS, QUICK_SECONDS
from ddpguide.launch.programs import load, path_of
from tests.programs.programs_support import PYTHON, check_ok, copy_program, run

BOTH = ["plan_cost.py", "plan_step.py"]
#: the formulas a reader reads in one sitting; what depends on when each part runs is plan_step.py's
FORMULAS_MAX_LINES = 450
LAYOUT = ["--layers", "2", "--dim", "256", "--ffn", "1024", "--pp", "2", "--dp-shard", "2", "--microbatches", "2"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_measure_then_predict(tmp_path):
    for name in BOTH:
        copy_program(name, tmp_path)
    # the benchmark's quick timings: what is checked is what --measure writes, not its precision
    check_ok(run([PYTHON, "plan_step.py", "--measure", "hw.json", "--ranks", "2", "--seconds", str(QUICK_SECONDS),
                  "--repeats", str(QUICK_REPEATS)], tmp_path, timeout=180))
    hw = json.loads((tmp_path / "hw.json").read_text())
    assert len(hw["matmul"]) == 48 and hw["backend"] == "gloo" and not hw["streams"]
    assert 0 < hw["cores"] <= 2.2 and hw["tp_module_seconds"] > 0 and hw["op_seconds"] > 0
    done = check_ok(run([PYTHON, "plan_step.py", "--hardware", "hw.json", *LAYOUT], tmp_path, timeout=60))
    printed = json.loads(done.stdout)
    p = load(tmp_path / "plan_step.py")
    assert p.plan_cost.__file__ == str(tmp_path / "plan_cost.py")  # the copy beside it, not the book's
    c = p.plan_cost
    m = c.Model(layers=2, dim=256, ffn=1024)
    lay = c.Layout(pp=2, dp_shard=2, microbatches=2)
    expected = p.predict(m, lay, c.Policy(), c.Hardware(**hw), 8, 64)
    assert printed["step"]["total"] == pytest.approx(expected["step"]["total"])
    assert printed["peak_memory"] == expected["peak_memory"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, message", [
    (["--hardware", "missing.json"], "--hardware missing.json: no such file"),
    (["--measure", "no/hw.json"], "--measure no/hw.json: no folder"),
    (["--measure", "hw.json", "--ranks", "0"], "--ranks 0: must be at least 1"),
    (["--measure", "hw.json", "--seconds", "0"], "--seconds 0: must be more than 0"),
    (["--sweep", "hw.json"], "--sweep: run it under torchrun"),
    (["--hardware", "plan_cost.py", "--tp", "3"], "does not divide the model"),
    (["--tp", "x"], "argument --tp: invalid int value: 'x'"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    for name in BOTH:
        copy_program(name, tmp_path)
    done = run([PYTHON, "plan_step.py", *args], tmp_path, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == BOTH


@pytest.mark.multiprocess
def test_a_sweep_of_no_repeats_is_refused_under_torchrun(tmp_path):
    for name in BOTH:
        copy_program(name, tmp_path)
    done = run([PYTHON, "plan_step.py", "--sweep", "hw.json", "--repeats", "0"], tmp_path, timeout=60,
               env={"LOCAL_WORLD_SIZE": "1"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "plan_step.py: --repeats 0: must be at least 1\n")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == BOTH


def test_the_formulas_fit_one_sitting():
    """plan_cost.py holds memory, compute and collectives, each formula once, and stays within
    FORMULAS_MAX_LINES: the schedule's order, the calls each pass waits for, the overlaps and
    the parts of memory alive at once are plan_step.py's."""
    lines = len(path_of("plan_cost.py").read_text().splitlines())
    assert lines <= FORMULAS_MAX_LINES, f"plan_cost.py has {lines} lines (at most {FORMULAS_MAX_LINES})"
