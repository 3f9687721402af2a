"""ddp_spawn.py: DDP equals one process on the whole batch, learns the digits, resumes exactly."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from ddpguide.launch import report as reports
from tests.programs.programs_support import (
    PYTHON,
    check_ok,
    copy_program,
    files_in,
    load_program,
    parse_error,
    run,
)


def one_process_toy_weights(program, toy: dict, world_size: int) -> dict[str, torch.Tensor]:
    """The toy part trained by one process on the whole batch (every rank's rows at once)."""
    torch.manual_seed(toy["seed"])
    model = program.ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=toy["lr"])
    x, y = program.toy_batch(program.TOY_ROWS_PER_RANK * world_size, toy["seed"])
    for _ in range(toy["steps"]):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_toy_weights_equal_one_process_on_the_whole_batch(spawn_default_run):
    folder, _, out = spawn_default_run
    expected = one_process_toy_weights(load_program(folder / "ddp_spawn.py"), out["toy"],
                                       out["world_size"])
    assert out["toy"]["steps"] >= 3 and set(out["toy"]["weights"]) == set(expected)
    for name, weights in out["toy"]["weights"].items():
        # float32: averaging two half-batch means vs one mean differs in the last bits only
        torch.testing.assert_close(torch.tensor(weights), expected[name], rtol=0, atol=1e-6)


def test_the_convnet_learns_the_digits_and_counts_every_test_image_once(spawn_default_run):
    folder, result, out = spawn_default_run
    assert out["dataset"] == "digits" and out["world_size"] == 2
    assert out["test_images"] == 360  # 180 per rank, none padded
    assert out["accuracy"] > 0.9
    assert out["epochs_run"] == [0, 1, 2]
    # the logged loss: one mean over every rank's batches per epoch, the same on every rank
    losses = out["epoch_losses"]
    assert len(losses) == 3 and losses[2] < losses[0]
    for epoch, loss in enumerate(losses):
        assert f"epoch {epoch}: mean loss {loss:.4f} (all ranks)" in result.stdout
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and state["optimizer"]["state"]  # momentum buffers saved
    assert not (folder / "checkpoint.pt.tmp").exists()
    assert result.stdout.count("test accuracy") == 1  # printed by rank 0 only
    assert "data: digits, 1437 training and 360 test images" in result.stdout


@pytest.mark.timeout(200)
def test_a_second_run_resumes_after_the_saved_epoch(spawn_default_run, tmp_path):
    folder, _, _ = spawn_default_run
    for name in ("ddp_spawn.py", "checkpoint.pt"):
        shutil.copy(folder / name, tmp_path / name)
    result = check_ok(run([PYTHON, "ddp_spawn.py", "--epochs", "4", "--report", "resumed.json"],
                          tmp_path, timeout=150))
    out = reports.read(tmp_path / "resumed.json", "ddp_spawn.py")
    assert "resumed from checkpoint.pt: epochs 0-2 done" in result.stdout
    assert out["epochs_run"] == [3]
    assert "epoch 2:" not in result.stdout and "epoch 3:" in result.stdout
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 3


def test_bad_input_from_the_shell_is_one_line_exit_2_and_nothing_written(tmp_path):
    copy_program("ddp_spawn.py", tmp_path)
    before = files_in(tmp_path)
    result = run([PYTHON, "ddp_spawn.py", "--epochs", "0", "--report", "out.json"], tmp_path,
                 timeout=60)
    assert (result.returncode, result.stderr, result.stdout) == (
        2, "ddp_spawn.py: error: argument --epochs: expected a value > 0, got 0\n", "")
    assert files_in(tmp_path) == before


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "argument --world-size: expected a value > 0, got 0"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--lr", "inf"], "argument --lr: expected a value > 0, got inf"),
    (["--report", "missing/out.json"], "argument --report: cannot write a file at 'missing/out.json'"),
    (["--checkpoint", "broken.pt"], "argument --checkpoint: 'broken.pt' is not a checkpoint "
                                    "of this program (move it away to start afresh)"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys,
                                                          args, message):
    path = copy_program("ddp_spawn.py", tmp_path)
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    before = files_in(tmp_path)
    assert parse_error(path, args, monkeypatch, capsys) == f"ddp_spawn.py: error: {message}\n"
    assert files_in(tmp_path) == before
