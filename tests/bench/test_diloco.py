"""The diloco suite and its program, diloco_digits.py: the checks it makes, fed planted errors."""

from __future__ import annotations

import itertools

import pytest

from ddpguide.bench import appendix, diloco
from ddpguide.launch.programs import load


@pytest.fixture(scope="module")
def program():
    return load("diloco_digits.py")


def test_h1_lr1_no_momentum_equals_ddp_and_a_wrong_outer_lr_breaks_it(program):
    args = program.parse(["--exact-steps", "4"])
    sets = program.data(0)
    assert program.exactness(args, sets=sets) < 1e-12
    assert program.exactness(args, outer_lr=0.9, sets=sets) > 1e-6   # planted: outer lr 0.9


def test_groups_that_start_apart_are_caught(program, monkeypatch):
    args = program.parse(["--steps", "4", "--sync-every", "2"])
    run = {"name": "apart", "h": 2, "inner": "adamw", "lr": 3e-3, "outer_lr": 0.7, "momentum": 0.9}
    together = program.train(run, args)
    assert together["groups_equal"] and together["all_committed"]
    seeds = itertools.count(1)
    make = program.make_model
    monkeypatch.setattr(program, "make_model", lambda seed: make(next(seeds)))   # planted
    assert not program.train(run, args)["groups_equal"]


def test_the_report_and_the_ratio(program, tmp_path):
    path = tmp_path / "diloco.json"
    program.main(["--steps", "10", "--sync-every", "5", "--exact-steps", "2", "--eval-every", "5",
                  "--report", str(path)])
    from ddpguide.launch.report import read

    report = read(path)
    assert all(c["ok"] for c in report["checks"]) and len(report["checks"]) == 4
    assert report["diloco_loss_over_ddp_loss_h5"] == report["diloco_h5"]["loss"] / report["ddp"]["loss"]
    assert [s for s, _ in report["diloco_h5"]["curve"]] == [5, 10]
    assert [s for s, _ in report["ddp"]["curve"]] == [5, 10]
    ratios = diloco.ratios_of([report], (5,))
    assert ratios["diloco_bytes_over_ddp_times_h"] == [1.0]
    assert ratios["diloco_loss_over_ddp_loss_h5"] == [report["diloco_loss_over_ddp_loss_h5"]]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "10", "--sync-every", "3"], "--sync-every 3: each H must be at least 1 and divide --steps 10"),
    (["--groups", "1"], "--groups must be at least 2: one group has nobody to sync with"),
    (["--outer-momentum", "1"], "the learning rates must be positive and --outer-momentum in [0, 1)"),
])
def test_bad_input_is_one_line_and_writes_nothing(program, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as ended:
        program.main([*argv, "--report", str(tmp_path / "r.json")])
    assert ended.value.code == 2
    assert capsys.readouterr().err == f"diloco_digits.py: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_every_ratio_has_its_anchor():
    names = {f"diloco_loss_over_ddp_loss_h{h}" for h in diloco.SYNC_EVERY}
    assert names | {"diloco_bytes_over_ddp_times_h", "diloco_h1_lr1_gap"} == set(appendix.ANCHORS["diloco"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quick_mode_runs_the_program_and_reports_every_ratio():
    report = diloco.run(quick=True)
    assert set(report.ratios) == set(appendix.ANCHORS["diloco"])
    assert report.ratios["diloco_bytes_over_ddp_times_h"] == 1.0
    assert report.ratios["diloco_h1_lr1_gap"] < 1e-12
    assert all(report.ratios[f"diloco_loss_over_ddp_loss_h{h}"] > 0 for h in diloco.SYNC_EVERY)
