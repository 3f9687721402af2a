"""``python -m ddpguide.bench.plan_loopback --add FILE``: the loopback rows of a saved plan report
measured again (train.py's runs planted here), the cluster's rows kept as they were, the doubled
terms scored again over both; a file that is not a plan report refused in one line."""

from __future__ import annotations

import json

import pytest

from ddpguide.bench import plan_loopback
from ddpguide.plan import measure, saved, search


def _planted(monkeypatch, shared_over_alone: float):
    """Every loopback run: the saved cluster's table (its matmul rates, its node link on both
    levels, no burst), a step of 0.2 s, one rank alone at 1e10 FLOP/s and the ranks together at that many times it."""
    p = search.program()
    bench = saved.load()
    calls = []

    def run_beside(p_, layout, model, seq, batch, dtype, steps=5, cache=None, rate_window=0.0):
        calls.append(rate_window)
        hw = saved.cluster_hardware(p, bench)
        hw.links, hw.gpus_per_node = {"node": hw.links["node"][:2] + [0.0], "net": hw.links["node"][:2] + [0.0]}, 8
        return hw, {"step_seconds": 0.2, "peak_flops": 2e10, "alone_flops": 1e10,
                    "shared_flops": shared_over_alone * 1e10, "shared_windows": [[1e10] * layout.world] * 5}
    monkeypatch.setattr(measure, "run_beside", run_beside)
    return bench, calls


def test_the_loopback_rows_are_replaced_and_the_cluster_rows_kept(monkeypatch, tmp_path):
    bench, calls = _planted(monkeypatch, 1.5)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(bench))
    out = plan_loopback.add_to(path)
    assert calls == [plan_loopback.RATE_WINDOW] * len(plan_loopback.LOOPBACK)
    assert json.loads(path.read_text()) == out
    kept = [m for m in bench["measurements"] if not m["name"].startswith(plan_loopback.MEASUREMENTS)]
    assert out["measurements"][:len(kept)] == kept  # the cluster's, the memory's, the published rows
    loop = [m for m in out["measurements"] if m["name"].startswith("loopback ")]
    assert len(loop) == len(plan_loopback.LOOPBACK)
    assert all(m["details"]["cores_in_ranks"] == 1.5 and m["details"]["record"]["alone_flops"] == 1e10 for m in loop)
    assert {k: v for k, v in out["ratios"].items() if not k.startswith(plan_loopback.RATIOS)} == {
        k: v for k, v in bench["ratios"].items() if not k.startswith(plan_loopback.RATIOS)}
    for m in loop:
        label = m["name"][len("loopback "):-len(": step")]
        assert out["ratios"][f"step_predicted_over_measured_loopback: {label}"] == pytest.approx(
            m["details"]["predicted_ms"] / 200)
    assert out["notes"][:-1] == [n for n in bench["notes"] if not n.startswith(plan_loopback.NOTE)]
    assert out["notes"][-1].startswith("loopback rows: measured alone from ")
    again = plan_loopback.merged(out, plan_loopback.Report("plan"), "loopback rows: again")
    assert [n for n in again["notes"] if n.startswith("loopback rows:")] == ["loopback rows: again"]


def test_the_cores_the_ranks_got_move_the_prediction(monkeypatch, tmp_path):
    """The same planted runs with the ranks together at twice the rate: every loopback layout
    predicted faster, the widest (nearly all compute) by nearly half."""
    results = []
    for together in (1.0, 2.0):
        bench, _ = _planted(monkeypatch, together)
        path = tmp_path / f"plan-{together}.json"
        path.write_text(json.dumps(bench))
        results.append(plan_loopback.add_to(path)["ratios"])
    keys = [k for k in results[0] if k.startswith("step_predicted_over_measured_loopback:")]
    assert len(keys) == len(plan_loopback.LOOPBACK)
    assert all(results[1][k] < results[0][k] for k in keys)
    assert results[1][keys[-1]] / results[0][keys[-1]] == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("text", ["{}", '{"suite": "failures", "measurements": []}', "not json"])
def test_add_refuses_a_file_that_is_not_a_plan_report_in_one_line(tmp_path, capsys, text):
    path = tmp_path / "other.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as ended:
        plan_loopback.main(["--add", str(path)])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1 and path.read_text() == text
    assert err == (f"python -m ddpguide.bench.plan_loopback: error: --add {path}: not a saved report of the plan "
                   "suite (with its cluster hardware) (see --help)\n")
