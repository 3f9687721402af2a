"""A rejoin with 1 GiB more state: its prediction's parts, read from a run's report, and the
measurement added to a saved failures report alone."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest

from ddpguide.bench import failures, failures_state
from ddpguide.bench.report import Report
from ddpguide.failures import engine, runs


def _run(failed: bool = False) -> dict:
    """A kill at t = 10 s of group 1; its new incarnation started at 13.0 s, healed at 14.5 s."""
    return {"failures": [{"what": "SIGKILL (kill)", "groups": [1], "time": 10.0,
                          "start_s": 2.0, "start_after_s": 4.0}],
            "checks": [{"name": "heals_match_donor", "ok": not failed, "problems": []}],
            "started": [{"group": 1, "time": 0.5}, {"group": 1, "time": 13.0}],
            "healed": [{"group": 1, "time": 14.5}], "seconds": 30.0, "commands": ["c"]}


@pytest.fixture
def ran(monkeypatch):
    """runs.run_ft and runs.StartProbe answering with ``_run()``, and what run_ft was given."""
    given: dict = {}

    @contextmanager
    def probe(folder, state_mb=0):
        given["probe_state_mb"] = state_mb
        yield lambda kind="": {"start_s": 2.0}

    def run_ft(folder, **kw):
        given.update(kw)
        return given.get("report") or _run()

    monkeypatch.setattr(runs, "StartProbe", probe)
    monkeypatch.setattr(runs, "run_ft", run_ft)
    monkeypatch.setattr(failures_state, "heal_path_bytes_per_s", lambda megabytes: 2**28)
    return given


def test_the_rejoin_is_predicted_from_its_parts_with_the_state_in_b(ran, tmp_path):
    report = Report("failures")
    failures_state.run(report, tmp_path, bandwidth=2**30)
    assert ran["state_mb"] == ran["probe_state_mb"] == 1024 and ran["kinds"] == ("kill",)
    b = runs.heal_bytes(engine.Settings(state_mb=1024))
    assert b == 2**30 + 8 * 165
    predicted = 0.05 + 3.0 + (0.05 + 0.1) / 2 + b / 2**30   # m/2 + P (median) + (s+k)/2 + B/W
    rejoin = report.get("rejoin kill 1gb")
    assert rejoin.value == pytest.approx(4.5)
    assert rejoin.details["predicted_s"] == pytest.approx(predicted)
    assert rejoin.details["kill_to_started_s"] == pytest.approx(3.0)
    assert rejoin.details["started_to_healed_s"] == pytest.approx(1.5)
    assert report.ratios[failures_state.RATIO] == pytest.approx(4.5 / predicted)
    by_heal_path = predicted - b / 2**30 + b / 2**28          # W along the heal's path
    assert rejoin.details["predicted_by_heal_path_s"] == pytest.approx(by_heal_path)
    assert report.ratios[failures_state.RATIO_HEAL_PATH] == pytest.approx(4.5 / by_heal_path)
    assert failures.ANCHORS[failures_state.RATIO][2] == "0.8-1.25"


def test_a_run_whose_checks_failed_gives_no_ratio(ran, tmp_path):
    ran["report"] = _run(failed=True)
    with pytest.raises(RuntimeError, match="failed checks \\['heals_match_donor'\\]"):
        failures_state.run(Report("failures"), tmp_path, bandwidth=2**30)


def test_the_measurement_is_added_to_a_saved_report_in_place_of_an_older_one(ran, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(failures_state, "loopback_bytes_per_s", lambda: 2**30)
    saved = Report("failures")
    saved.add("stall kill", 1.0, "s")
    saved.add("rejoin kill 1gb", 99.0, "s")
    saved.ratios["stall_measured_over_predicted_kill"] = 1.0
    path = tmp_path / "failures.json"
    path.write_text(json.dumps(saved.to_dict()))
    failures_state.add_to(path, tmp_path / "run")
    got = json.loads(path.read_text())
    assert [m["name"] for m in got["measurements"]] == [
        "stall kill", "process start P kill 1gb", "rejoin kill 1gb"]
    assert got["ratios"]["stall_measured_over_predicted_kill"] == 1.0
    assert {failures_state.RATIO, failures_state.RATIO_HEAL_PATH} <= set(got["ratios"])
    assert [n for n in got["notes"] if n.startswith(failures_state.RATIO)][0].endswith(
        "by python -m ddpguide.bench.failures_state --add")


def test_add_refuses_a_file_that_is_not_a_failures_report_in_one_line(tmp_path, capsys):
    other = tmp_path / "ddp.json"
    other.write_text(json.dumps({"suite": "ddp", "ratios": {}}))
    before = os.stat(other).st_mtime_ns
    with pytest.raises(SystemExit) as ended:
        failures_state.main(["--add", str(other)])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        f"python -m ddpguide.bench.failures_state: error: --add {other}: not a saved report "
        "of the failures suite (see --help)\n")
    assert os.stat(other).st_mtime_ns == before and sorted(tmp_path.iterdir()) == [other]


@pytest.mark.multiprocess
def test_the_heal_path_moves_a_state_from_another_process_through_torchfts_transport():
    assert 1e6 < failures_state.heal_path_bytes_per_s(1) < 1e12
