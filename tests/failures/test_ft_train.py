"""ft_train.py (chapter 17) on live runs with failures injected: every invariant holds."""

from __future__ import annotations

import socket

import pytest

from ddpguide.failures import checks, runs
from ddpguide.launch import programs

pytestmark = pytest.mark.multiprocess


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--replica-ids", "a,b,a", "--groups", "3"], "replica id used twice: a"),
    (["--groups", "1", "--kill-group", "0", "--at", "3"],
     "--kill-group needs --groups 2 or more: a survivor to heal from"),
    (["--lighthouse", "http://127.0.0.1:PORT"], "lighthouse http://127.0.0.1:PORT cannot be reached"),
])
def test_bad_input_one_line_exit_2_nothing_written(args, message, tmp_path):
    port = str(closed_port())
    args = [a.replace("PORT", port) for a in args]
    done = programs.run(runs.PROGRAM, *args, "--report", str(tmp_path / "r.json"),
                        expect=2, echo=False, launch="typed", timeout=60)
    assert done.output.strip() == f"ft_train.py: error: {message.replace('PORT', port)}"
    assert list(tmp_path.iterdir()) == []


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


def test_chaos_short_every_invariant_holds():
    report = runs.run_ft("--chaos", "2", "--seed", "2", "--steps", "30", "--chaos-gap", "8",
                         "--step-seconds", "0.05")
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
    assert [k["where"] for k in report["killed"]] == ["step", "step", "heal"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_chaos_long_every_invariant_holds(seed):
    report = runs.run_ft("--chaos", "6", "--seed", str(seed), "--steps", "80",
                         "--chaos-gap", "8", "--step-seconds", "0.05", timeout=400)
    found = checks.all_invariants(report, programs.load(runs.PROGRAM))
    assert found["ok"], found
