"""The chapter's program, run as a reader runs it (torchrun, a copy alone in a folder): at 2
and 4 ranks, k = 1 and 2, with and without dropped tokens, pure EP and a 2x2 mesh, every
check against one process passes; bad input is one line and exit status 2."""

from __future__ import annotations

import re
import shutil

import pytest

from ddpguide.launch.programs import path_of, run, torchrun
from tests.programs.programs_support import PYTHON
from tests.programs.programs_support import run as run_in_shell
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused

NAME = "moe_expert_parallel.py"
CASES = [(k, f) for k in (1, 2) for f in ("1", "4")]


def launch(nproc: int, *args: str):
    done = run(NAME, *args, launcher=torchrun(nproc), timeout=300, expect=None, echo=False,
               report=True)
    assert done.returncode == 0, done.text()
    return done


def assert_every_case_checked(done, layouts: list[str], nproc: int):
    checks = assert_report_agrees(done)["checks"]  # the report says what the program printed
    assert all(c["ok"] for c in checks), done.text()
    assert len(checks) == len(layouts) * (1 + 3 * len(CASES)), done.text()
    assert "all checks passed" in done.lines()
    meshes = [line for line in done.lines() if line.startswith("== mesh ")]
    assert [m.split(" dims")[0] for m in meshes] == layouts
    for k, factor in CASES:
        case = [c for c in checks if (c.get("k"), c.get("capacity_factor")) == (k, float(factor))]
        dropped = [c["dropped"] for c in case if "dropped" in c]
        assert len(dropped) == len(layouts), done.text()
        assert all(c["choices"] == 16 * nproc * k for c in case if "choices" in c)
        # capacity factor 1 overflows (random routing of 16 tokens over 4 experts); with
        # factor E every expert could take the whole group and nothing is dropped
        assert all(d > 0 for d in dropped) if factor == "1" else dropped == [0] * len(layouts)
        for what in ("output, aux loss", "parameters after 3 SGD steps"):
            assert sum(what in c["name"] and c["worst"] <= 1e-10 for c in case) == len(layouts)
    # every rank printed its own line for every case, whole
    for rank in range(nproc):
        mine = [line for line in done.lines() if line.startswith(f"rank {rank} (")]
        assert len(mine) == len(layouts) * len(CASES), done.text()
        assert all(line.endswith("choices") for line in mine)


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


REFUSALS = [
    (["--experts", "3"], "2",
     "--experts 3: 3 experts do not split evenly over an expert-parallel size of 2 "
     "(2 ranks, --dp 1)"),
    (["--experts", "2", "--dp", "1"], "4",
     "--experts 2: 2 experts do not split evenly over an expert-parallel size of 4 "
     "(4 ranks, --dp 1)"),
    (["--top-k", "5"], "2", "--top-k 5: a token chooses between 1 and E = 4 experts"),
    (["--top-k", "0"], "2", "--top-k 0: a token chooses between 1 and E = 4 experts"),
    (["--capacity-factor", "0"], "2", "--capacity-factor 0: must be greater than 0"),
    (["--capacity-factor", "1", "-0.5"], "2", "--capacity-factor -0.5: must be greater than 0"),
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
