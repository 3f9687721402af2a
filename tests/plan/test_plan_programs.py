"""plan_measure.py and plan_step.py run as a reader runs them, in a folder with the plan_cost.py
they import and nothing else: plan_measure.py --measure writes this machine's hardware and a
report of its checks, plan_step.py --hardware predicts from it (the same as the module
computes), bad input is one line, exit status 2, nothing written (Python's own __pycache__ of
the imported plan_cost.py aside)."""

from __future__ import annotations

import json

import pytest

from ddpguide.bench.plan import QUICK_SECONDS
from ddpguide.launch import report as reports
from ddpguide.launch.programs import load, path_of
from tests.programs.programs_support import PYTHON, check_ok, copy_program, run

ALL = ["plan_cost.py", "plan_measure.py", "plan_step.py"]
#: the formulas a reader reads in one sitting; what depends on when each part runs is plan_step.py's
FORMULAS_MAX_LINES = 450
CHECKS = ("every matmul rate is positive", "bandwidth and the small operation are positive",
          "the busy processes got at most their own cores")
LAYOUT = ["--layers", "2", "--dim", "256", "--ffn", "1024", "--pp", "2", "--dp-shard", "2", "--microbatches", "2"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_measure_then_predict(tmp_path):
    for name in ALL:
        copy_program(name, tmp_path)
    # the benchmark's quick timings (the Run: line's first command): what is checked is what
    # --measure writes, not its precision
    check_ok(run([PYTHON, "plan_measure.py", "--measure", "hw.json", "--ranks", "2", "--seconds", str(QUICK_SECONDS),
                  "--report", "report.json"], tmp_path, timeout=180))
    hw = json.loads((tmp_path / "hw.json").read_text())
    assert len(hw["matmul"]) == 48 and hw["backend"] == "gloo" and not hw["streams"]
    assert 0 < hw["cores"] <= 2.2 and hw["tp_module_seconds"] > 0 and hw["op_seconds"] > 0
    found = reports.read(tmp_path / "report.json")
    assert [c["name"] for c in found["checks"]] == list(CHECKS) and not reports.failed(found)
    assert found["hardware"]["cores"] == hw["cores"] and "matmul" not in found["hardware"]
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
@pytest.mark.parametrize("program, args, message", [
    ("plan_step.py", ["--hardware", "missing.json"], "--hardware missing.json: no such file"),
    ("plan_measure.py", ["--measure", "no/hw.json"], "--measure no/hw.json: no folder"),
    ("plan_measure.py", ["--measure", "hw.json", "--report", "no/r.json"], "--report no/r.json: no folder"),
    ("plan_measure.py", ["--measure", "hw.json", "--ranks", "0"], "--ranks 0: must be at least 1"),
    ("plan_measure.py", ["--measure", "hw.json", "--seconds", "0"], "--seconds 0: must be more than 0"),
    ("plan_measure.py", ["--sweep", "hw.json"], "--sweep: run it under torchrun"),
    ("plan_measure.py", [], "give one of --measure FILE and --sweep FILE"),
    ("plan_step.py", ["--measure", "hw.json"], "unrecognized arguments: --measure hw.json"),
    ("plan_step.py", ["--hardware", "plan_cost.py", "--tp", "3"], "does not divide the model"),
    ("plan_step.py", ["--tp", "x"], "argument --tp: invalid int value: 'x'"),
])
def test_bad_input_one_line_exit_2(tmp_path, program, args, message):
    for name in ALL:
        copy_program(name, tmp_path)
    done = run([PYTHON, program, *args], tmp_path, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stderr.startswith(f"{program}: ")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ALL


@pytest.mark.multiprocess
def test_a_sweep_of_no_repeats_is_refused_under_torchrun(tmp_path):
    for name in ALL:
        copy_program(name, tmp_path)
    done = run([PYTHON, "plan_measure.py", "--sweep", "hw.json", "--repeats", "0"], tmp_path, timeout=60,
               env={"LOCAL_WORLD_SIZE": "1"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "plan_measure.py: --repeats 0: must be at least 1\n")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ALL


def test_the_measurements_checks_fail_on_planted_errors():
    """plan_measure.py's report checks: a measured table passes; a zero matmul rate, more cores
    than busy processes, a negative alpha or a zero beta each fails its check."""
    m = load(path_of("plan_measure.py"))
    good = {"matmul": [[64, 64, 64, 1e9]], "bandwidth": 1e10, "op_seconds": 1e-6, "cores": 1.9,
            "links": {"node": [1e-4, 1e-9, 0.0], "net": [5e-4, 4e-7, 65536.0]}}
    assert all(ok for _, ok in m.measure_checks(good, 2) + m.sweep_checks(good))
    planted = [({**good, "matmul": [[64, 64, 64, 0.0]]}, 0), ({**good, "cores": 2.5}, 2)]
    for hw, which in planted:
        assert [ok for _, ok in m.measure_checks(hw, 2)] == [k != which for k in range(3)]
    for links in ({"node": [-1e-4, 1e-9, 0.0]}, {"node": [1e-4, 0.0, 0.0]}):
        assert [ok for _, ok in m.sweep_checks({**good, "links": links})] == [False]


def test_the_formulas_fit_one_sitting():
    """plan_cost.py holds memory, compute and collectives, each formula once, and stays within
    FORMULAS_MAX_LINES: the schedule's order, the calls each pass waits for, the overlaps and
    the parts of memory alive at once are plan_step.py's."""
    lines = len(path_of("plan_cost.py").read_text().splitlines())
    assert lines <= FORMULAS_MAX_LINES, f"plan_cost.py has {lines} lines (at most {FORMULAS_MAX_LINES})"
