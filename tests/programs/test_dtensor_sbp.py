"""dtensor_sbp.py: placements, their local shapes, the collective behind each change."""

from __future__ import annotations

import re

import pytest

from tests.programs.programs_support import TORCHRUN, check_ok, copy_program, parse_error, run


def rank_lines(stdout: str, header: str) -> list[str]:
    """The four rank lines printed under ``header``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return lines[start + 1:start + 5]


@pytest.mark.timeout(150)
def test_every_placement_and_redistribution_checks_out(tmp_path):
    copy_program("dtensor_sbp.py", tmp_path)
    result = check_ok(run([TORCHRUN, "--standalone", "--nproc-per-node=4", "dtensor_sbp.py"],
                          tmp_path, timeout=120))
    out = result.stdout
    assert out.rstrip().endswith("all checks passed")
    assert "False" not in out
    expected_shapes = {
        "distribute Shard(0)": "(2, 4)", "distribute Replicate()": "(8, 4)",
        "distribute Partial()": "(8, 4)", "S(0) -> S(1)": "(8, 1)", "S(0) -> R": "(8, 4)",
        "x S(1) @ w S(0)": "(8, 6)", "P -> R": "(8, 6)", "P -> S(0)": "(2, 6)",
        "2x2 mesh, distribute (S(0), S(1))": "(4, 2)", "2x2 mesh, distribute (R, S(0))": "(4, 4)",
        "(S(0), S(1)) -> (R, R)": "(8, 4)",
    }
    for header, shape in expected_shapes.items():
        lines = rank_lines(out, header)
        assert [re.match(r"  \[rank (\d)\]", line).group(1) for line in lines] == list("0123")
        assert all(f"local shape {shape}" in line for line in lines), (header, lines)
    assert "x S(1) @ w S(0): (Partial(sum),), collectives: none" in out
    assert "P -> R: (Replicate(),), collectives: all_reduce" in out
    assert "P -> S(0): (Shard(dim=0),), collectives: reduce_scatter_tensor" in out
    assert "S(0) -> R: (Replicate(),), collectives: all_gather_into_tensor" in out
    # (R, S(0)) on the 2x2 mesh: ranks 0 and 2 hold rows 0-3, ranks 1 and 3 rows 4-7
    firsts = [line.split("starting with ")[1].split(",")[0]
              for line in rank_lines(out, "2x2 mesh, distribute (R, S(0))")]
    assert firsts == ["0", "16", "0", "16"]


def test_it_asks_for_four_ranks(tmp_path, monkeypatch, capsys):
    path = copy_program("dtensor_sbp.py", tmp_path)
    stderr = parse_error(path, [], monkeypatch, capsys, check="check_launch")
    assert stderr == ("dtensor_sbp.py: error: needs 4 ranks (WORLD_SIZE=None): start me with "
                      "torchrun --standalone --nproc-per-node=4 dtensor_sbp.py\n")


def test_the_2d_mesh_groups_get_the_program_s_timeout(monkeypatch):
    """Without backend_override a mesh's groups take c10d's default timeout (30 min on gloo),
    not the 60 s the program gives its default group."""
    import torch.distributed as dist

    from ddpguide.launch.programs import load

    program = load("dtensor_sbp.py")
    asked = {}
    monkeypatch.setattr(program, "init_device_mesh", lambda *args, **kwargs: asked.update(kwargs))
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        program.mesh_2d("cpu", ("rows", "cols"))
        options = asked["backend_override"]
        assert set(options) == {"rows", "cols"}
        assert all(o._timeout == program.TIMEOUT for o in options.values()), backend
