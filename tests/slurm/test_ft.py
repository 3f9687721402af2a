"""torchft's replica groups as Slurm jobs: each allocation's rows numbered after the last's
(so that chapter 17's checks see a requeued group as restarted), and the run itself on a
4-node Slurm: a group's node lost, its job requeued, healed while the other group commits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpguide.cluster import Spec
from ddpguide.failures import checks
from ddpguide.slurm import config, ft, up

needs_slurm = pytest.mark.skipif(config.missing_prerequisite() is not None,
                                 reason=str(config.missing_prerequisite()))


def write_rows(folder: Path, allocation: int, rows: list[dict]) -> None:
    path = folder / f"allocation{allocation}" / "rows"
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"group{rows[0]['group']}.rank0.jsonl", "a") as out:
        for row in rows:
            out.write(json.dumps({"rank": 0, "incarnation": 0, **row}) + "\n")


def requeued_group(folder: Path, healed: bool) -> dict:
    """Group 1 commits steps 0 and 1, its node is lost, its next allocation (healed or not) ends."""
    write_rows(folder, 0, [{"event": "started", "group": 1, "time": 1.0},
                           *({"event": "step", "group": 1, "time": 2.0 + s, "step": s,
                              "committed": True} for s in (0, 1))])
    again = [{"event": "started", "group": 1, "time": 5.0}]
    if healed:
        again.append({"event": "healed", "group": 1, "time": 6.0, "step": 1, "weights": "w"})
    write_rows(folder, 1, [*again, {"event": "final", "group": 1, "time": 7.0, "step": 1}])
    rows = ft.read_rows(folder)
    report = {"groups": 2, "group_size": 1, "step": [], "final": [], "healed": [], "started": []}
    for row in rows:
        report.setdefault(row["event"], []).append(row)
    return report


def test_the_rows_of_a_requeued_allocation_count_as_a_restart(tmp_path):
    report = requeued_group(tmp_path, healed=True)
    assert [r["incarnation"] for r in report["started"]] == [0, ft.ALLOCATION]
    assert checks.back_and_healed(report) == []


def test_a_requeued_group_back_without_healing_fails_the_check(tmp_path):
    report = requeued_group(tmp_path, healed=False)
    assert checks.back_and_healed(report) == ["group 1 rank 0: back without healing from a peer"]


def test_a_process_naming_the_run_folder_is_found_left_running(tmp_path):
    import subprocess
    import sys

    # Popen may return before the new program's arguments are in /proc/PID/cmdline (the
    # kernel lets a vfork parent go on mid-exec): the child says when it runs
    child = "import time; print('running', flush=True); time.sleep(30)"
    with subprocess.Popen([sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "running\n"
            assert proc.pid in ft.left_running(tmp_path)
        finally:
            proc.kill()
    proc.wait()
    assert ft.left_running(tmp_path) == []


def test_the_run_refuses_a_cluster_without_a_spare_node():
    class Three:
        nodes = [object()] * 3

    with pytest.raises(ValueError, match="needs 4 nodes, not 3"):
        ft.group_lost(Three(), Path("/nonexistent"))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_slurm
def test_a_group_whose_node_is_lost_is_requeued_and_heals_while_the_other_commits(tmp_path, slurm_machine):
    with up(Spec(nodes=ft.NODES)) as slurm:
        run = ft.group_lost(slurm, tmp_path)
    failed = {c["name"]: c["problems"] for c in run.report["checks"] if not c["ok"]}
    assert failed == {}
    assert [(f["JobState"], f["Restarts"]) for f in run.fields] == [("COMPLETED", "0"),
                                                                   ("COMPLETED", "1")]
    survivor = [r["step"] for r in run.report["step"] if r["group"] == 0 and r["committed"]
                and run.times["lost"] < r["time"] < run.times["committed_again"]]
    assert survivor, "group 0 committed nothing while group 1 was away"
    healed = [r for r in run.report["healed"] if r["group"] == 1 and r["incarnation"] >= ft.ALLOCATION]
    assert [r["incarnation"] for r in healed] == [ft.ALLOCATION]  # once, in the second allocation
    assert 0 < healed[0]["step"] < run.report["steps"]   # healed mid-run, not after the end
