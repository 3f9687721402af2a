"""Sharded checkpoints with ``torch.distributed.checkpoint``: atomic, resharding, checked.

:func:`save_sharded` and :func:`load_sharded` are what a training loop calls on
every rank. Each rank writes only the shards it holds; the checkpoint's
``.metadata`` records which piece of which tensor every file holds, so a
checkpoint saved by N ranks loads into M ranks (the model and optimizer must be
sharded for the current world before the load, and DCP reads the pieces each
rank owns now).

Atomic, for a directory
    ``os.rename`` moves a directory to a free name atomically, but cannot
    replace a non-empty directory (``ENOTEMPTY``), so there is no one-step
    swap of two checkpoints. The save therefore writes into a fresh temporary
    directory beside the target, and only when every rank has finished:

    1. ``<dir>`` -> ``<dir>.prev`` (the old checkpoint, still complete);
    2. temporary -> ``<dir>`` (the new one, complete);
    3. ``<dir>.prev`` is deleted.

    Killed at any instant, this leaves ``<dir>`` complete, or (between steps 1
    and 2 only) ``<dir>.prev`` complete; :func:`find_checkpoint` and
    :func:`load_sharded` use ``<dir>.prev`` when ``<dir>`` is missing. Rank 0
    renames, so with several machines the directory must be on a shared file
    system (as DCP's own metadata already requires).

Usage, on every rank of a training job (also with one process and no process group)::

    start = 0
    if find_checkpoint(path) is not None:
        start = load_sharded(model, optimizer, path)["epoch"] + 1
    for epoch in range(start, epochs):
        ...
        save_sharded(model, optimizer, path, extra={"epoch": epoch})

The "another model" check
    Before loading, the saved metadata's keys and shapes are compared with the
    model's state dict (:func:`check_fits`): a checkpoint of another model
    fails with one line naming the first key that differs, instead of an
    error deep inside DCP or, worse, a partial load.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ddpguide.core.checkpoint import (
    previous_path,  # <dir>.prev, named as for one-file checkpoints
)

EXTRA_FILE = "extra.pt"
METADATA_FILE = ".metadata"


class CheckpointMismatch(ValueError):
    """A checkpoint that was written for another model (or is not a checkpoint)."""


def _temporary_prefix(directory: Path) -> str:
    return f".{directory.name}.saving-"


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a complete DCP checkpoint (its metadata is written last)."""
    return (Path(directory) / METADATA_FILE).is_file()


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint at ``directory``, else at ``directory.prev``, else None."""
    for candidate in (Path(directory), previous_path(directory)):
        if is_checkpoint(candidate):
            return candidate
    return None


# ---------------------------------------------------------------- every rank agrees

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the value itself without a process group)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def _single_process_is_intended():
    """Without a process group, DCP warns on every call that it assumes one process: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(directory: Path) -> None:
    """Make renames inside ``directory`` durable (a kill does not need it; a power cut does)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- state and checks

def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's view: DTensor shards for sharded models, whole tensors otherwise."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _read_metadata(directory: Path):
    try:
        return dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # a truncated or foreign file raises many kinds of errors
        raise CheckpointMismatch(
            f"{directory} has unreadable checkpoint metadata ({type(exc).__name__})") from None


def _first_difference(model_state: dict[str, Any], metadata) -> str | None:
    saved = {key[len("model."):]: entry for key, entry in metadata.state_dict_metadata.items()
             if key.startswith("model.")}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            return f"it has no {key!r}"
        size = getattr(saved[key], "size", None)
        if size is None:
            return f"its {key!r} is not a tensor"
        if tuple(size) != tuple(value.shape):
            return (f"{key!r} has shape {tuple(size)} there but {tuple(value.shape)} "
                    "in this model")
    unknown = [key for key in saved if key not in model_state]
    if unknown:
        return f"it has {unknown[0]!r}, which this model lacks"
    return None


def _raise_unless_fits(model_state: dict[str, Any], directory: Path) -> None:
    difference = _first_difference(model_state, _read_metadata(directory))
    if difference:
        raise CheckpointMismatch(f"checkpoint {directory} was written for another model: {difference}")


def check_fits(model: nn.Module, directory: str | os.PathLike) -> None:
    """Raise :class:`CheckpointMismatch` unless the checkpoint's model keys and shapes are the model's.

    Shapes are global (a DTensor's ``shape``), so the check does not depend on
    how many ranks wrote or read the checkpoint. Call it on every rank.
    """
    _raise_unless_fits(get_model_state_dict(model), Path(directory))


# ---------------------------------------------------------------- save and load

def target_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot receive a checkpoint, or None (rank 0 checks before writing;
    a command line checks before it starts anything)."""
    if not directory.parent.is_dir():
        return f"checkpoint directory {str(directory)!r}: its parent does not exist"
    if directory.exists() and not directory.is_dir():
        return f"checkpoint directory {str(directory)!r} is a file"
    if directory.is_dir() and any(directory.iterdir()) and not is_checkpoint(directory):
        return (f"checkpoint directory {str(directory)!r} holds files that are not a checkpoint; "
                "refusing to replace it")
    return None


def _remove_stale_temporaries(directory: Path) -> None:
    """Delete what killed saves left beside ``directory`` (one job saves a checkpoint at a time)."""
    for leftover in directory.parent.glob(_temporary_prefix(directory) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_in(temporary: Path, directory: Path) -> None:
    """Move the finished ``temporary`` to ``directory``; see the module docstring for why so."""
    previous = previous_path(directory)
    if is_checkpoint(directory):
        # The current checkpoint is complete, so an older .prev (left by a kill) is not needed.
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(directory, previous)
    elif directory.is_dir():
        directory.rmdir()  # empty (checked before writing)
    # From here until the rename below, only .prev exists: loaders fall back to it.
    os.rename(temporary, directory)
    _fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 directory: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Save model (and optimizer) shards of every rank to ``directory``, atomically.

    Call on every rank. ``extra`` (rank 0's copy; plain Python values and
    tensors, e.g. the epoch) comes back from :func:`load_sharded`. Raises
    ``ValueError`` on every rank, before anything is written, when
    ``directory`` cannot take a checkpoint.
    """
    directory = Path(directory).absolute()
    problem, made = None, None
    if _rank() == 0:
        problem = target_problem(directory)
        if problem is None:
            _remove_stale_temporaries(directory)
            made = tempfile.mkdtemp(prefix=_temporary_prefix(directory), dir=directory.parent)
    problem, made = _from_rank0((problem, made))
    if problem:
        raise ValueError(problem)
    temporary = Path(made)
    try:
        with _single_process_is_intended():
            dcp.save(_state_dicts(model, optimizer), checkpoint_id=temporary,
                     no_dist=not dist.is_initialized())
        if _rank() == 0:
            with open(temporary / EXTRA_FILE, "wb") as f:
                torch.save(dict(extra or {}), f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(temporary)
        _barrier()  # every rank's files are complete before the swap
        if _rank() == 0:
            _swap_in(temporary, directory)
        _barrier()  # and nobody reads before it
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    return directory


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 directory: str | os.PathLike) -> dict[str, Any]:
    """Load the checkpoint at ``directory`` (or its ``.prev``) into model and optimizer.

    Call on every rank, with the model (and optimizer) already sharded for the
    current world: the load reshards to it. Returns the ``extra`` dict saved
    with it. Raises ``FileNotFoundError`` if there is no checkpoint and
    :class:`CheckpointMismatch` (naming the first differing key) if it was
    written for another model; the model is untouched in both cases.
    """
    directory = Path(directory).absolute()
    found = _from_rank0(find_checkpoint(directory))  # one answer, even while a save runs
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint at {directory} (nor at {previous_path(directory).name})")
    state = _state_dicts(model, optimizer)
    _raise_unless_fits(state["model"], found)
    # dcp.load fills this rank's shards in place, reading the overlapping pieces of each file.
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=found, no_dist=not dist.is_initialized())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return read_extra(found)


def read_extra(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``extra`` dict of the checkpoint at ``directory`` (or its ``.prev``), no tensors read.

    Raises ``FileNotFoundError`` if there is no checkpoint.
    """
    found = find_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"no checkpoint at {directory}")
    extra_file = found / EXTRA_FILE
    return torch.load(extra_file, weights_only=True) if extra_file.exists() else {}
