"""The chapter's program, run as a reader runs it (torchrun, a copy alone in a folder): at 2
and 4 ranks, float64 (experts one by one) and float32 (one grouped multiply), k = 1 and 2,
dropless and with a capacity that drops, pure EP and a 2x2 mesh, every check against one
process passes; the balance run's bias balances a hot expert, and a bias updated with the
wrong sign fails the check; bad input is one line and exit status 2."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from ddpguide.launch.programs import path_of, run, torchrun
from tests.edited_programs import edited_copy
from tests.programs.programs_support import PYTHON, TORCHRUN
from tests.programs.programs_support import run as run_in_shell
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused

NAME = "moe_expert_parallel.py"
CASES = [(dtype, k, f) for dtype in ("float64", "float32") for k in (1, 2) for f in (None, 1.0)]
TOLERANCE = {"float64": 1e-10, "float32": 1e-6}
WAYS = ["none", "aux", "z", "bias"]


def launch(nproc: int, *args: str):
    done = run(NAME, *args, launcher=torchrun(nproc), timeout=300, expect=None, echo=False,
               report=True)
    assert done.returncode == 0, done.text()
    return done


def assert_every_case_checked(done, layouts: list[str], nproc: int):
    checks = assert_report_agrees(done)["checks"]  # the report says what the program printed
    assert all(c["ok"] for c in checks), done.text()
    # per layout: the exchange, 3 per case; then the grouped multiply and the balance run
    assert len(checks) == len(layouts) * (1 + 3 * len(CASES)) + 2, done.text()
    assert "all checks passed" in done.lines()
    meshes = [line for line in done.lines() if line.startswith("== mesh ")]
    assert [m.split(" dims")[0] for m in meshes] == layouts
    for dtype, k, factor in CASES:
        case = [c for c in checks
                if (c.get("dtype"), c.get("k"), c.get("capacity_factor", "-")) == (dtype, k, factor)]
        assert len(case) == 3 * len(layouts), done.text()
        dropped = [c["dropped"] for c in case if "dropped" in c]
        assert all(c["choices"] == 16 * nproc * k for c in case if "choices" in c)
        # capacity factor 1 overflows (random routing of 16 tokens over 4 experts);
        # dropless drops nothing
        assert all(d > 0 for d in dropped) if factor == 1.0 else dropped == [0] * len(layouts)
        for what in ("output, losses and gradients", "parameters and biases after 3 SGD steps"):
            assert sum(what in c["name"] and c["worst"] <= TOLERANCE[dtype]
                       and c["tolerance"] == TOLERANCE[dtype] for c in case) == len(layouts)
    # every rank printed its own line for every case, whole, with the experts' kernel
    for rank in range(nproc):
        mine = [line for line in done.lines() if line.startswith(f"rank {rank} (")]
        assert len(mine) == len(layouts) * len(CASES), done.text()
        assert all(line.endswith("choices") for line in mine)
        assert all(("(one grouped multiply), float32" in line) != ("(one by one), float64" in line)
                   for line in mine), mine
    grouped = [c for c in checks if c["name"] == "torch._grouped_mm equals the expert loop"]
    assert len(grouped) == 1 and grouped[0]["worst"] <= 1e-6
    assert_balanced(done.report)


def assert_balanced(report: dict, steps: int = 60):
    """The bias brings the hot expert to within BALANCE["within"] of the mean; the z-loss
    alone does not balance, but lowers the z-loss below the run without balancing."""
    balance = report["balance"]
    assert list(balance) == WAYS
    assert all(len(run["busiest"]) == len(run["z_loss"]) == steps for run in balance.values())
    late = {way: sum(run["busiest"][steps // 2:]) / (steps - steps // 2)
            for way, run in balance.items()}
    (check,) = [c for c in report["checks"] if c["name"] == "the bias balances the hot expert"]
    assert check["late_busiest"] == pytest.approx(late)
    assert check["ok"] and late["bias"] <= check["within"] < late["none"]
    assert late["aux"] <= check["within"] < late["z"]  # the z-loss does not balance...
    assert balance["z"]["z_loss"][-1] < balance["none"]["z_loss"][-1] / 2  # ...it shrinks logits
    assert all(run["busiest"][0] > 3.5 for run in balance.values())  # expert 0 starts hot


@pytest.mark.timeout(400)
def test_two_ranks_every_variant_equals_one_process():
    done = launch(2)
    assert_every_case_checked(done, ["== mesh [[0, 1]]"], 2)
    assert any(c["name"].startswith("AllToAll (by hand) equals torch's") for c in done.report["checks"])


@pytest.mark.timeout(500)
def test_four_ranks_pure_ep_and_a_2x2_mesh_equal_one_process():
    done = launch(4, "--dp", "1", "2")
    assert_every_case_checked(done, ["== mesh [[0, 1, 2, 3]]", "== mesh [[0, 1], [2, 3]]"], 4)
    lines = done.lines()
    # on the 2x2 mesh, ranks 2 and 3 hold the same experts as ranks 0 and 1
    assert any(line.startswith("rank 3 (dp 1, ep 1): experts 2-3") for line in lines)
    assert any(line.startswith("rank 3 (dp 0, ep 3): experts 3-3") for line in lines)


ONE_CASE = ["--dtype", "float64", "--top-k", "1", "--capacity-factor", "dropless", "--report",
            "r.json"]


@pytest.mark.timeout(300)
def test_a_bias_updated_with_the_wrong_sign_fails_the_balance_check(tmp_path):
    """The planted error: raise the busy expert's bias instead of lowering it."""
    rule = "rate * torch.sign(load.mean() - load)"
    edited_copy(NAME, tmp_path, (rule, "rate * torch.sign(load - load.mean())"))
    done = run_in_shell([TORCHRUN, "--standalone", "--nproc-per-node=2", NAME, *ONE_CASE],
                        tmp_path, timeout=250)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    assert failed == ["the bias balances the hot expert"], report["checks"]
    late = report["checks"][-1]["late_busiest"]
    assert late["bias"] > late["none"] > report["checks"][-1]["within"]  # the bias made it worse
    assert "SOME CHECKS FAILED" in done.stdout


@pytest.mark.timeout(300)
def test_grouped_offsets_one_row_off_fail_the_float32_checks(tmp_path):
    """The planted error: each expert's block of rows ends one row late in the grouped
    multiply; the float32 checks against one process and against the loop fail, float64
    (one by one) does not."""
    rule = "ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)"
    edited_copy(NAME, tmp_path, (rule, rule + "\n        ends[:-1] += 1"))
    done = run_in_shell([TORCHRUN, "--standalone", "--nproc-per-node=2", NAME, "--top-k", "1",
                         "--capacity-factor", "dropless", "--balance-steps", "0", "--report",
                         "r.json"], tmp_path, timeout=250)
    assert done.returncode == 1, done.stdout + done.stderr
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    failed = [c["name"] for c in checks if not c["ok"]]
    assert failed == ["float32, k=1, dropless: output, losses and gradients",
                      "float32, k=1, dropless: parameters and biases after 3 SGD steps",
                      "torch._grouped_mm equals the expert loop"], checks


REFUSALS = [
    (["--experts", "3"], "2",
     "--experts 3: 3 experts do not split evenly over an expert-parallel size of 2 "
     "(2 ranks, --dp 1)"),
    (["--experts", "2", "--dp", "1"], "4",
     "--experts 2: 2 experts do not split evenly over an expert-parallel size of 4 "
     "(4 ranks, --dp 1)"),
    (["--top-k", "5"], "2", "--top-k 5: a token chooses between 1 and E = 4 experts"),
    (["--top-k", "0"], "2", "--top-k 0: a token chooses between 1 and E = 4 experts"),
    (["--capacity-factor", "0"], "2", "--capacity-factor 0: must be greater than 0, or dropless"),
    (["--capacity-factor", "1", "-0.5"], "2",
     "--capacity-factor -0.5: must be greater than 0, or dropless"),
    (["--capacity-factor", "none"], "2",
     "--capacity-factor none: must be greater than 0, or dropless"),
    (["--dtype", "bfloat16"], "2",
     "moe_expert_parallel.py: argument --dtype: invalid choice: 'bfloat16' (choose from "
     "'float64', 'float32')"),
    (["--z-loss", "-1"], "2", "--z-loss -1: must be 0 or more"),
    (["--bias-rate", "nan"], "2", "--bias-rate nan: must be 0 or more"),
    (["--balance-steps", "1"], "2",
     "--balance-steps 1: must be 0 (no balance run) or at least 2"),
    (["--balance-tokens", "0"], "2", "--balance-tokens 0: must be at least 1"),
    (["--dp", "3"], "4", "--dp 3: the 4 ranks do not split into 3 data-parallel rows"),
    (["--top-k", "two"], "2",
     "moe_expert_parallel.py: argument --top-k: invalid int value: 'two'"),
    (["--report", "/no/such/r.json"], "2", "--report /no/such/r.json: no folder /no/such"),
]


@pytest.mark.parametrize("args, world, message", REFUSALS)
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, world, message):
    """The program's own check, called in this process as a rank started by torchrun runs it."""
    from ddpguide.launch.programs import load

    program = load(NAME)
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as stopped:
        program.parse_args(args)
    captured = capsys.readouterr()
    assert (stopped.value.code, captured.out, captured.err) == (2, "", message + "\n")


@pytest.mark.timeout(120)
def test_bad_input_from_the_shell_writes_nothing(tmp_path):
    shutil.copy(path_of(NAME), tmp_path / NAME)
    done = run_in_shell([PYTHON, NAME, "--experts", "3"], tmp_path, timeout=100,
                        env={"WORLD_SIZE": "2", "RANK": "0"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", REFUSALS[0][2] + "\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # nothing written


@pytest.mark.timeout(120)
def test_a_report_into_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    shutil.copy(path_of(NAME), tmp_path / NAME)
    assert_report_into_missing_folder_refused(NAME, tmp_path, {"WORLD_SIZE": "2", "RANK": "0"},
                                              "--report missing/r.json: no folder ")


@pytest.mark.timeout(120)
def test_without_torchrun_it_says_how_to_start_it(tmp_path):
    shutil.copy(path_of(NAME), tmp_path / NAME)
    done = run_in_shell([PYTHON, NAME], tmp_path, timeout=100)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "start it with torchrun: torchrun --standalone --nproc-per-node=2 "
               "moe_expert_parallel.py\n")


@pytest.mark.timeout(120)
def test_a_rank_other_than_0_exits_2_silently(tmp_path):
    shutil.copy(path_of(NAME), tmp_path / NAME)
    done = run_in_shell([PYTHON, NAME, "--top-k", "9"], tmp_path, timeout=100,
                        env={"WORLD_SIZE": "2", "RANK": "1"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "")


@pytest.mark.typed  # torchrun's own stopping of the workers and its report
@pytest.mark.timeout(200)
def test_under_torchrun_rank_0_says_why_before_the_job_stops():
    """The other ranks wait for rank 0 to print: torchrun stops all workers when one exits."""
    done = run(NAME, "--top-k", "5", launcher=torchrun(2), timeout=150, expect=None, echo=False)
    said = [line for line in done.program_lines() if re.match(r"--[a-z]", line)]
    assert said == ["--top-k 5: a token chooses between 1 and E = 4 experts"], done.text()
    assert "exitcode: 2" in done.output and done.returncode != 0
