"""The printed command's measurement added to a saved plan report alone: bad input refused in
one line with the file untouched, and the rest of the report kept (no cluster needed: the
cluster and the measurement are planted)."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest

from ddpguide.bench import plan_command
from ddpguide.bench.appendix import ANCHORS

SAVED = {"suite": "plan", "ratios": {"rank_correlation": 0.9, plan_command.STEP: 3.0},
         "measurements": [{"name": "TP 4: step", "value": 1.0}, {"name": "command: old", "value": 9.0}],
         "notes": ["measured before", f"{plan_command.STEP}: an older note"]}


@pytest.mark.parametrize("text, message", [
    ('{"suite": "failures"}', "not a saved report of the plan suite"),
    ("not json", "not a saved report of the plan suite"),
    (None, "not a saved report of the plan suite"),
])
def test_add_refuses_what_is_not_a_plan_report_in_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "plan.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as ended:
        plan_command.main(["--add", str(path)])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err == (f"python -m ddpguide.bench.plan_command: error: --add {path}: "
                                             f"{message} (see --help)\n")
    assert (path.read_text() if text is not None else None) == text


def test_add_replaces_only_its_own_figures(tmp_path, monkeypatch):
    import ddpguide.cluster
    from ddpguide.plan import measure

    @contextlib.contextmanager
    def up(spec):
        yield SimpleNamespace(spec=spec)

    def planted(report, p, cluster, hw, folder, steps=20):
        report.ratios.update({plan_command.STEP: 1.1, plan_command.MEMORY: 1.0})
        report.add("command: PP x FSDP 2 x 2, 1F1B m4", 400.0, "ms")
    monkeypatch.setattr(ddpguide.cluster, "up", up)
    monkeypatch.setattr(measure, "cluster_hardware", lambda p, cluster, folder: "hw")
    monkeypatch.setattr(plan_command, "measure", planted)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(SAVED))
    saved = plan_command.add_to(path, tmp_path)
    assert json.loads(path.read_text()) == saved
    assert saved["ratios"] == {"rank_correlation": 0.9, plan_command.STEP: 1.1, plan_command.MEMORY: 1.0}
    assert [m["name"] for m in saved["measurements"]] == ["TP 4: step", "command: PP x FSDP 2 x 2, 1F1B m4"]
    assert saved["notes"][0] == "measured before" and len(saved["notes"]) == 2
    assert saved["notes"][1].startswith(f"{plan_command.STEP}: measured alone at ")


def test_add_trackers_replaces_the_tracker_ratios_only(tmp_path, monkeypatch):
    from ddpguide.plan import checks as plan
    from ddpguide.plan import tracker

    monkeypatch.setattr(tracker, "every_layout", lambda p, seq, batch, say: {"TP 4": 0.92, "DDP 4": 1.0})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**SAVED, "ratios": {**SAVED["ratios"], f"{plan.TRACKER}FSDP 4": 0.98}}))
    saved = plan_command.add_to(path, tmp_path, ("trackers",))
    assert saved["ratios"] == {"rank_correlation": 0.9, plan_command.STEP: 3.0, f"{plan.TRACKER}TP 4": 0.92,
                               f"{plan.TRACKER}DDP 4": 1.0}
    assert saved["measurements"] == SAVED["measurements"]
    assert saved["notes"][:2] == SAVED["notes"] and saved["notes"][2].startswith(
        "memory_predicted_over_tracker: measured alone at ")


def test_the_ratios_are_anchored_in_the_appendix():
    assert {k: ANCHORS["plan"][k].goal for k in plan_command.ANCHORS} == {
        plan_command.STEP: "0.8-1.25", plan_command.MEMORY: "0.9-1.1"}
