"""Checkpoints: atomic under SIGKILL, fall back when corrupt, refuse what does not fit."""

from __future__ import annotations

import os
import random
import signal
import time
import warnings

import pytest
import torch

from ddpguide.core.checkpoint import (
    CheckpointError,
    check_checkpoint_fits,
    check_writable_directory,
    load_checkpoint,
    previous_path,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from ddpguide.core.models import ConvNet, ToyModel


def _state(epoch: int, model: torch.nn.Module | None = None) -> dict:
    model = model or ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return training_state(epoch, model, optimizer)


def test_resume_continues_after_the_saved_epoch(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(1)
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()  # momentum buffers exist now and must survive the round trip
    save_checkpoint(training_state(4, model, optimizer, history=[{"epoch": 4}]), path)

    fresh = ToyModel()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = load_checkpoint(path)
    assert restore_training_state(state, fresh, fresh_opt) == 5
    assert state["history"] == [{"epoch": 4}]
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(optimizer.state[a]["momentum_buffer"], fresh_opt.state[b]["momentum_buffer"])


def test_no_checkpoint_means_none(tmp_path):
    assert load_checkpoint(tmp_path / "missing.pt") is None


def test_the_previous_checkpoint_is_kept(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    assert torch.load(previous_path(path), weights_only=True)["epoch"] == 0
    assert load_checkpoint(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.prev"]


def test_a_save_after_a_writer_died_mid_rotation_leaves_no_extra_file(tmp_path):
    """Killed after keeping the fallback but before moving the new file in, a
    writer leaves ``ckpt.pt`` and ``ckpt.pt.prev`` as two links to one file;
    renaming a third link of that file onto ``ckpt.pt.prev`` is a no-op."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    previous_path(path).unlink()
    os.link(path, previous_path(path))  # the state such a kill leaves behind
    for epoch in (2, 3):
        save_checkpoint(_state(epoch), path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.prev"]
        assert load_checkpoint(path)["epoch"] == epoch
        assert torch.load(previous_path(path), weights_only=True)["epoch"] == epoch - 1
        assert not os.path.samefile(path, previous_path(path))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_latest_falls_back_to_previous_with_a_warning(tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(len(data)))
    with pytest.warns(RuntimeWarning, match=r"ckpt\.pt is unreadable .*trying the previous one"):
        state = load_checkpoint(path)
    assert state["epoch"] == 0


def test_no_readable_copy_is_an_error_naming_both(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    previous_path(path).write_bytes(b"nor this")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="no readable checkpoint") as info:
            load_checkpoint(path)
    assert "ckpt.pt:" in str(info.value) and "ckpt.pt.prev:" in str(info.value)
    assert "\n" not in str(info.value)


class _Payload:
    """An arbitrary object: unpickling it would run code, so weights_only must refuse."""


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 0, "model": {}, "payload": _Payload()}, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="Unpickl|weights_only"):
            load_checkpoint(path)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0, ConvNet()), path)
    with pytest.raises(CheckpointError, match="does not fit this model") as info:
        check_checkpoint_fits(path, ToyModel())
    assert "\n" not in str(info.value)
    assert check_checkpoint_fits(tmp_path / "none.pt", ToyModel()) is None


def test_unwritable_directories_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        check_writable_directory(tmp_path / "missing" / "ckpt.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        save_checkpoint(_state(0), tmp_path / "missing" / "ckpt.pt")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError):
        check_writable_directory(a_file / "ckpt.pt")


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_sigkill_at_any_moment_of_a_write_leaves_a_loadable_checkpoint(tmp_path):
    """Whatever instant the writer dies at, the latest file loads, without falling back."""
    from ddpguide.launch import warm
    from tests.core.checkpoint_workers import big_tensor, save_forever

    path = tmp_path / "ckpt.pt"
    rng = random.Random(0)
    big = big_tensor()
    last_epoch = -1
    context = warm.context(os.environ)  # writers forked from the warm server: no import each
    for _ in range(5):
        receive, send = context.Pipe(duplex=False)
        writer = context.Process(target=save_forever, args=(str(path), send))
        writer.start()
        try:
            assert receive.poll(60) and receive.recv() == "saved"
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            writer.kill()  # SIGKILL
            writer.join(10)
        assert writer.exitcode == -signal.SIGKILL
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback would mean the latest file was damaged
            state = load_checkpoint(path)
        assert torch.equal(state["model"]["w"], big + state["epoch"])  # complete, not mixed
        last_epoch = state["epoch"]
    assert last_epoch >= 0
    # The next save removes the temporary files killed writers left behind.
    save_checkpoint(_state(last_epoch + 1), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "ckpt.pt.prev"]


@pytest.mark.timeout(180)
def test_resuming_after_an_interruption_gives_the_uninterrupted_result(tmp_path):
    """Stop after epoch 2 (as a kill after that checkpoint would), resume to 5: same weights."""
    from ddpguide.launch.spawn import spawn
    from tests.core.checkpoint_workers import train_toy

    checkpoint = str(tmp_path / "ckpt.pt")
    whole = spawn(train_toy, 2, 5, echo=False, timeout=120)
    first = spawn(train_toy, 2, 3, checkpoint, echo=False, timeout=120)
    resumed = spawn(train_toy, 2, 5, checkpoint, echo=False, timeout=120)
    assert [r.start_epoch for r in resumed] == [3, 3]
    assert [e.epoch for e in first[0].epochs] == [0, 1, 2]
    assert [h["epoch"] for h in resumed[0].history] == [0, 1, 2, 3, 4]
    for name, value in whole[0].parameters.items():
        diff = (value - resumed[0].parameters[name]).abs().max().item()
        assert diff <= 1e-6, (name, diff)
        assert torch.equal(resumed[0].parameters[name], resumed[1].parameters[name])
