"""ft_train.py (chapter 17) on live runs with failures injected: every invariant holds."""

from __future__ import annotations

import socket

import pytest

from ddpguide.failures import checks, runs
from ddpguide.launch import programs


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD = [
    (["--replica-ids", "a,b,a", "--groups", "3"], "replica id used twice: a"),
    (["--groups", "1", "--kill-group", "0", "--at", "3"],
     "--kill-group needs --groups 2 or more: a survivor to heal from"),
    (["--group-size", "3"], "--group-size is 1 (DDP) or 2 (FSDP2 over the group's two ranks)"),
    (["--kill-group", "1", "--at", "3", "--where", "checkpoint"],
     "--where checkpoint needs --checkpoint-every"),
    (["--groups", "2", "--local-groups", "1"],
     "--local-groups needs --lighthouse: the other groups must find it too"),
]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_input_is_refused_by_the_programs_checks(args, message, tmp_path, capsys):
    """The program's own checks, called in this process (the typed command is below)."""
    with pytest.raises(SystemExit) as ended:
        programs.load(runs.PROGRAM).main([*args, "--report", str(tmp_path / "r.json")])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f": error: {message}\n") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_bad_input_typed_one_line_exit_2_nothing_written(tmp_path):
    """As a reader types it: a lighthouse that cannot be reached, before anything starts."""
    port = str(closed_port())
    done = programs.run(runs.PROGRAM, "--lighthouse", f"http://127.0.0.1:{port}",
                        "--report", str(tmp_path / "r.json"),
                        expect=2, echo=False, launch="typed", timeout=60)
    assert done.output.strip() == \
        f"ft_train.py: error: lighthouse http://127.0.0.1:{port} cannot be reached"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_kill_inside_the_allreduce_every_invariant_holds():
    report = runs.run_ft("--steps", "10", "--kill-group", "1", "--at", "3", "--where", "allreduce")
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
    assert [k["where"] for k in report["killed"]] == ["allreduce"]
    assert [h["group"] for h in report["healed"]] == [1]
    assert {r["participants"] for r in report["step"] if r["committed"]} <= {1, 2}
    assert len(runs.ft_lost_s(report)) == 1
    # it died before its gradient left: the survivor's all-reduce failed, the step was not
    # committed in that quorum and was done again
    assert any(not r["committed"] for r in report["step"] if r["group"] == 0 and r["step"] == 3)


@pytest.mark.multiprocess
def test_hsdp_group_killed_inside_a_checkpoint_every_invariant_holds():
    """FT-HSDP: groups of 2 ranks with FSDP2 inside; both ranks of group 1 die inside the
    checkpoint after step 2; the spares heal from group 0, rank by rank."""
    report = runs.run_ft("--group-size", "2", "--steps", "10", "--kill-group", "1", "--at", "2",
                         "--where", "checkpoint", "--checkpoint-every", "3")
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
    assert sorted((k["rank"], k["where"], k["step"]) for k in report["killed"]) == [
        (0, "checkpoint", 2), (1, "checkpoint", 2)]
    assert sorted((h["group"], h["rank"]) for h in report["healed"]) == [(1, 0), (1, 1)]
    names = {(r["group"], r["step"]) for r in report["checkpoint"]}
    assert (0, 3) in names and (1, 3) not in names   # group 1's step-3 checkpoint was never made


@pytest.mark.multiprocess
def test_chaos_short_every_invariant_holds():
    report = runs.run_ft("--chaos", "2", "--seed", "2", "--steps", "30", "--chaos-gap", "8",
                         "--step-seconds", "0.05")
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
    assert [k["where"] for k in report["killed"]] == ["step", "step", "heal"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("seed, group_size", [(0, 1), (1, 1), (2, 2), (3, 2)])
def test_chaos_long_every_invariant_holds(seed, group_size):
    """6 kills of random groups at random places, checkpoints included, over 80 steps."""
    report = runs.run_ft("--chaos", "6", "--seed", str(seed), "--steps", "80",
                         "--group-size", str(group_size), "--checkpoint-every", "4",
                         "--chaos-gap", "8", "--step-seconds", "0.05", timeout=400)
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
    # the deaths are the planned ones, in order (a spare that heals past the end of the run
    # has no step left to die in)
    program = programs.load(runs.PROGRAM)
    for g in range(report["groups"]):
        plan = [d.split(":")[0] for d in program.deaths(report["planned_kills"], g)]
        died = [w for _, w in sorted({(k["incarnation"], k["where"]) for k in report["killed"]
                                      if k["group"] == g})]
        assert died == plan[:len(died)], (g, plan, died)
    assert report["killed"], "no kill landed"
