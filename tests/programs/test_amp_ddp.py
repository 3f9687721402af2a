"""amp_ddp.py: mixed precision trains the digits; the GradScaler's state is saved and restored."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.utils.data import DataLoader

from tests.programs.programs_support import (
    PYTHON,
    check_ok,
    copy_program,
    files_in,
    load_program,
    parse_error,
    run,
)
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused

STEPS_PER_EPOCH = math.ceil(math.ceil(1437 / 2) / 32)  # DistributedSampler pads to 719 per rank


def accuracy(stdout: str) -> float:
    return float(re.search(r"test accuracy ([\d.]+)%", stdout).group(1)) / 100


@pytest.mark.timeout(200)
def test_defaults_train_with_autocast_and_skip_syncbn_on_cpu(tmp_path):
    copy_program("amp_ddp.py", tmp_path)
    result = check_ok(run([PYTHON, "amp_ddp.py", "--report", "report.json"], tmp_path, timeout=150))
    on_gpus = torch.cuda.device_count() >= 2
    dtype = "float16" if on_gpus else "bfloat16"
    assert f"2 ranks on {'cuda' if on_gpus else 'cpu'}, autocast {dtype}" in result.stdout
    assert ("SyncBatchNorm skipped" in result.stdout) is not on_gpus
    assert accuracy(result.stdout) > 0.85
    # the report says what the program printed
    report = assert_report_agrees((json.loads((tmp_path / "report.json").read_text()), result.stdout.splitlines()))
    assert (report["dtype"], report["world_size"], report["first_epoch"]) == (dtype, 2, 0)
    assert f"test accuracy {report['accuracy']:.2%}" in result.stdout
    assert [e["epoch"] for e in report["epochs"]] == [0, 1, 2]
    assert all(f"epoch {e['epoch']}: last loss {e['last_loss']:.4f}, loss scale "
               f"{e['loss_scale'] if on_gpus else 'none'}" in result.stdout for e in report["epochs"])
    state = torch.load(tmp_path / "amp_checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and state["dtype"] == dtype and state["optimizer"]["state"]
    assert bool(state["scaler"]) is on_gpus  # a disabled scaler (bfloat16) has no state


def test_a_report_into_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    copy_program("amp_ddp.py", tmp_path)
    assert_report_into_missing_folder_refused("amp_ddp.py", tmp_path, {},
                                              "amp_ddp.py: error: --report missing/r.json: no folder ")


@pytest.mark.timeout(250)
def test_float16_scaler_state_is_checkpointed_and_restored(tmp_path):
    copy_program("amp_ddp.py", tmp_path)
    base = [PYTHON, "amp_ddp.py", "--dtype", "float16", "--checkpoint", "fp16.pt"]
    first = check_ok(run([*base, "--epochs", "1"], tmp_path, timeout=150))
    assert "autocast float16, GradScaler on" in first.stdout
    saved = torch.load(tmp_path / "fp16.pt", map_location="cpu", weights_only=True)["scaler"]
    assert set(saved) == {"scale", "growth_factor", "backoff_factor", "growth_interval",
                          "_growth_tracker"}
    assert saved["_growth_tracker"] == STEPS_PER_EPOCH  # no overflow in this run

    second = check_ok(run([*base, "--epochs", "2"], tmp_path, timeout=150))
    assert f"resumed after epoch 0, loss scale {saved['scale']}" in second.stdout
    resumed = torch.load(tmp_path / "fp16.pt", map_location="cpu", weights_only=True)["scaler"]
    # Restored, the tracker counts on from the first run instead of starting at 0 again.
    assert resumed["scale"] == saved["scale"]
    assert resumed["_growth_tracker"] == 2 * STEPS_PER_EPOCH


def test_a_checkpoint_of_another_dtype_is_refused(tmp_path, monkeypatch, capsys):
    path = copy_program("amp_ddp.py", tmp_path)
    torch.save({"epoch": 0, "model": {}, "optimizer": {}, "scaler": {}, "dtype": "float16"},
               tmp_path / "fp16.pt")
    before = files_in(tmp_path)
    stderr = parse_error(path, ["--dtype", "bfloat16", "--checkpoint", "fp16.pt"],
                         monkeypatch, capsys)
    assert stderr == ("amp_ddp.py: error: argument --dtype: bfloat16 differs from the float16 "
                      "that 'fp16.pt' was trained with\n")
    assert files_in(tmp_path) == before


def first_noise_of_each_worker(program, rank: int, worker_init_fn) -> list[torch.Tensor]:
    """The noise that each of a rank's two loader workers adds to its first image."""
    dataset = program.NoisyDigits(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    loader = DataLoader(dataset, batch_size=1, num_workers=2, worker_init_fn=worker_init_fn,
                        generator=torch.Generator().manual_seed(rank),
                        multiprocessing_context="fork")
    images = [image for image, _ in loader]
    return images[:2]  # batches go to the workers in turn: worker 0, then worker 1


@pytest.mark.multiprocess
def test_worker_init_fn_gives_every_worker_of_every_rank_its_own_noise(tmp_path):
    program = load_program(copy_program("amp_ddp.py", tmp_path))
    seeded = [noise for rank in (0, 1)
              for noise in first_noise_of_each_worker(program, rank, program.seed_worker)]
    assert all(not torch.equal(a, b) for i, a in enumerate(seeded) for b in seeded[i + 1:])
    # Without it every worker draws from a copy of the same generator: the same noise.
    unseeded = [noise for rank in (0, 1)
                for noise in first_noise_of_each_worker(program, rank, None)]
    assert all(torch.equal(unseeded[0], other) for other in unseeded[1:])
