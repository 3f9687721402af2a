"""ddp_torchrun.py: under torchrun it gives what ddp_spawn.py gives, and differs from it little."""

from __future__ import annotations

import difflib

import pytest
import torch

from ddpguide.launch import report as reports
from tests.programs.programs_support import (
    PROGRAMS,
    TORCHRUN,
    check_ok,
    copy_program,
    parse_error,
    run,
)


@pytest.mark.timeout(200)
def test_torchrun_gives_the_same_result_as_mp_spawn(spawn_default_run, tmp_path):
    _, _, spawned = spawn_default_run
    copy_program("ddp_torchrun.py", tmp_path)
    result = check_ok(run([TORCHRUN, "--standalone", "--nproc-per-node=2", "ddp_torchrun.py",
                           "--report", "out.json"], tmp_path, timeout=150))
    out = reports.read(tmp_path / "out.json", "ddp_torchrun.py")
    for key in ("dataset", "test_images", "epochs_run", "world_size", "backend"):
        assert out[key] == spawned[key], key
    # Same seeds, data and thread count: the same arithmetic (tolerance for safety).
    assert out["accuracy"] == pytest.approx(spawned["accuracy"], abs=1 / 360)
    assert out["epoch_losses"] == pytest.approx(spawned["epoch_losses"], abs=1e-4)
    for name, weights in out["toy"]["weights"].items():
        torch.testing.assert_close(torch.tensor(weights),
                                   torch.tensor(spawned["toy"]["weights"][name]),
                                   rtol=0, atol=1e-6)
    assert result.stdout.count("test accuracy") == 1


def code_lines(name: str) -> list[str]:
    """A program's lines after its docstring (from the first import on)."""
    lines = (PROGRAMS / name).read_text().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("import")):]


def test_the_two_programs_differ_only_in_how_they_start():
    spawn, torchrun = code_lines("ddp_spawn.py"), code_lines("ddp_torchrun.py")
    changed = [line for line in difflib.unified_diff(spawn, torchrun, lineterm="")
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    # starting (env:// instead of mp.spawn, the rank's device from LOCAL_RANK and
    # CUDA_VISIBLE_DEVICES, with the refusal of a GPU that torchrun's workers would share) and
    # failing (@record, --crash-rank) differ: 83 lines today
    assert len(changed) <= 85, "\n".join(changed)
    assert not any("loss.backward()" in line or "sampler.set_epoch" in line for line in changed)
    assert "+@record  # an exception escaping main() is written, with its traceback, to the error file" in changed
    assert any("init_method=\"env://\"" in line for line in changed if line.startswith("+"))
    assert any("mp.spawn(" in line for line in changed if line.startswith("-"))


def test_started_without_torchrun_it_says_how_to_start_it(tmp_path, monkeypatch, capsys):
    path = copy_program("ddp_torchrun.py", tmp_path)
    assert parse_error(path, [], monkeypatch, capsys) == (
        "ddp_torchrun.py: error: RANK is not set: start me with "
        "torchrun --standalone --nproc-per-node=2 ddp_torchrun.py\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp_torchrun.py"]
