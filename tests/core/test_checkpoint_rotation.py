"""Checkpoint rotation only moves forward: the fallback is always a state that was read back.

A latest file that fails to load is kept aside (``ckpt.pt.corrupt-<time>``), never
rotated into ``ckpt.pt.prev``; a bad target or a state that cannot be read back
changes nothing on disk.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from ddpguide.core.checkpoint import (
    CheckpointError,
    check_checkpoint_target,
    kept_aside,
    load_checkpoint,
    previous_path,
    save_checkpoint,
    training_state,
)
from ddpguide.core.models import ToyModel
from tests.file_snapshot import snapshot


def _state(epoch: int) -> dict:
    torch.manual_seed(epoch)
    model = ToyModel()
    return training_state(epoch, model, torch.optim.SGD(model.parameters(), lr=0.1))


def _epoch(path) -> int:
    return torch.load(path, weights_only=True)["epoch"]


def _damage(path, how: str) -> bytes:
    data = path.read_bytes()
    damaged = data[: len(data) // 2] if how == "truncate" else b"\x00garbage" * 64
    path.write_bytes(damaged)
    return damaged


@pytest.mark.parametrize("how, reason", [("truncate", "OSError"),
                                         ("garbage", "UnpicklingError")])
def test_a_corrupt_latest_is_kept_aside_and_the_good_fallback_stays(tmp_path, how, reason):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    good_fallback = previous_path(path).read_bytes()
    damaged = _damage(path, how)

    with pytest.warns(RuntimeWarning, match=r"ckpt\.pt is unreadable .*trying the previous one; "
                                            r"the next save keeps it as .*ckpt\.pt\.corrupt-<time>"):
        assert load_checkpoint(path)["epoch"] == 0
    with pytest.warns(RuntimeWarning) as record:
        save_checkpoint(_state(1), path)  # the resumed run finishes epoch 1 again

    (aside,) = kept_aside(path)
    assert aside.name.startswith("ckpt.pt.corrupt-") and aside.read_bytes() == damaged
    assert [str(w.message) for w in record] == [
        f"checkpoint {path} is unreadable ({reason}): kept as {aside}, not as the fallback "
        f"({previous_path(path)} is unchanged)"]
    assert previous_path(path).read_bytes() == good_fallback
    assert _epoch(path) == 1
    # Forward only: the next save makes the state it wrote and read back the fallback.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_checkpoint(_state(2), path)
    assert (_epoch(path), _epoch(previous_path(path))) == (2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt.pt", "ckpt.pt.prev", aside.name])


def test_a_readable_file_someone_else_wrote_becomes_the_fallback(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(_state(5), path)  # not written by this process: read before it is rotated
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_checkpoint(_state(6), path)
    assert (_epoch(path), _epoch(previous_path(path))) == (6, 5)
    assert kept_aside(path) == []


def test_a_file_that_is_no_checkpoint_is_kept_aside_not_made_the_fallback(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_text("my notes\n")
    with pytest.warns(RuntimeWarning, match=r"ckpt\.pt is unreadable \(UnpicklingError\): "
                                            r"kept as .*ckpt\.pt\.corrupt-"):
        save_checkpoint(_state(0), path)
    (aside,) = kept_aside(path)
    assert aside.read_text() == "my notes\n"
    assert not previous_path(path).exists()
    assert _epoch(path) == 0


def test_every_unreadable_file_is_kept_under_its_own_name(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    fallback = previous_path(path).read_bytes()
    kept = []
    for epoch in (2, 3):  # twice within one second: two names, nothing overwritten
        kept.append(_damage(path, "garbage")[: 8 * epoch] + bytes([epoch]))
        path.write_bytes(kept[-1])
        with pytest.warns(RuntimeWarning, match="kept as"):
            save_checkpoint(_state(epoch), path)
    assert sorted(p.read_bytes() for p in kept_aside(path)) == sorted(kept)
    assert previous_path(path).read_bytes() == fallback
    assert _epoch(path) == 3


def test_an_unreadable_file_linked_as_both_names_leaves_no_fallback(tmp_path):
    """A writer killed mid-rotation leaves ``ckpt.pt`` and ``ckpt.pt.prev`` as links to
    one file; if that file is then unreadable, neither name may keep it."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    os.link(path, previous_path(path))
    damaged = _damage(path, "garbage")
    with pytest.warns(RuntimeWarning, match="kept as"):
        save_checkpoint(_state(1), path)
    (aside,) = kept_aside(path)
    assert aside.read_bytes() == damaged
    assert not previous_path(path).exists()
    assert _epoch(path) == 1


class _Payload:
    """Saved by torch.save, refused by a weights_only load: a checkpoint nobody could resume."""


def test_a_state_that_cannot_be_read_back_changes_nothing(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(_state(0), path)
    save_checkpoint(_state(1), path)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint({**_state(2), "payload": _Payload()}, path)
    message = str(info.value)
    assert message.startswith(f"checkpoint for {path} could not be read back, nothing was "
                              "replaced: UnpicklingError: ")
    assert "\n" not in message
    assert snapshot(tmp_path) == before


def _bad_targets(tmp_path):
    """(description, path, state, exact message) of every bad save."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "fb.pt.prev").mkdir()
    os.mkfifo(tmp_path / "fifo.pt")
    ok = _state(0)
    return [
        ("target is a directory", tmp_path / "a_dir", ok,
         f"checkpoint {tmp_path / 'a_dir'} is a directory"),
        ("target is not a regular file", tmp_path / "fifo.pt", ok,
         f"checkpoint {tmp_path / 'fifo.pt'} is not a regular file"),
        ("fallback name is a directory", tmp_path / "fb.pt", ok,
         f"checkpoint fallback {tmp_path / 'fb.pt.prev'} is a directory"),
        ("directory missing", tmp_path / "missing" / "ckpt.pt", ok,
         f"checkpoint directory {tmp_path / 'missing'} does not exist"),
        ("directory is a file", tmp_path / "a_file" / "ckpt.pt", ok,
         f"checkpoint directory {tmp_path / 'a_file'} is not a directory"),
        ("no epoch", tmp_path / "ckpt.pt", {"model": {}},
         "a training checkpoint is a dict with 'epoch' and 'model' entries, got keys ['model']"),
        ("not a dict", tmp_path / "ckpt.pt", [1, 2],
         "a training checkpoint is a dict with 'epoch' and 'model' entries, got list"),
    ]


def test_bad_targets_and_states_are_refused_in_one_line_and_change_nothing(tmp_path):
    for what, path, state, message in _bad_targets(tmp_path):
        before = snapshot(tmp_path)
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(state, path)
        assert str(info.value) == message, what
        assert snapshot(tmp_path) == before, what
        if isinstance(state, dict) and "epoch" in state:
            with pytest.raises(CheckpointError) as info:
                check_checkpoint_target(path)
            assert str(info.value) == message, what
            assert snapshot(tmp_path) == before, what


def test_a_directory_nobody_may_write_is_refused_before_writing(unwritable_directory):
    directory, reason = unwritable_directory
    for call in (lambda: check_checkpoint_target(f"{directory}/ckpt.pt"),
                 lambda: save_checkpoint(_state(0), f"{directory}/ckpt.pt")):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value) == f"checkpoint directory {directory} is not writable ({reason})"


def test_a_fifo_is_never_opened_for_reading(tmp_path):
    """Reading a FIFO would wait for a writer forever: refuse it at once."""
    os.mkfifo(tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError) as info, pytest.warns(RuntimeWarning, match="unreadable"):
        load_checkpoint(tmp_path / "ckpt.pt")
    assert str(info.value) == f"no readable checkpoint: {tmp_path / 'ckpt.pt'}: is not a regular file"
