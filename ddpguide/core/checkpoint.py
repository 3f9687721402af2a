"""Checkpoints that survive crashes: atomic writes, a fallback copy, safe loading.

The rules, each for a reason:

* only rank 0 writes (every rank holds the same weights; N writers race);
* write to a temporary file in the same directory, flush and fsync, then
  ``os.replace`` it over the old one: a reader sees the old file or the new
  one, never half of one, whenever the writer is killed;
* keep the previous checkpoint, so a corrupt or truncated latest one falls
  back to it with a warning;
* rotate only forward: a new file is read back before it replaces anything,
  and the latest file becomes the fallback only once it has been read back
  (by this process, or now); one that cannot be read is kept aside as
  ``path.corrupt-<time>`` and the good fallback stays;
* load with ``map_location`` (a GPU checkpoint loads on CPU and vice versa) and
  ``weights_only=True`` (a checkpoint is a pickle; loading must never run code);
* resume at the epoch *after* the saved one: never repeat or skip an epoch.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpguide.core.checkpoint_rotation import (  # the public API is here
    CORRUPT_SUFFIX,
    PREVIOUS_SUFFIX,
    CheckpointError,
    check_checkpoint_target,
    check_writable_directory,
    kept_aside,
    previous_path,
    read_checkpoint_file,
    save_checkpoint,
)
from ddpguide.core.commands import one_line

__all__ = [
    "check_checkpoint_fits", "check_checkpoint_target", "check_writable_directory",
    "CheckpointError", "CORRUPT_SUFFIX", "kept_aside", "load_checkpoint", "one_line",
    "previous_path", "PREVIOUS_SUFFIX", "read_checkpoint_file", "restore_training_state",
    "save_checkpoint", "training_state", "unwrap",
]


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any] | None:
    """The latest readable checkpoint at ``path`` (or its fallback), or None if there is none.

    A latest file that cannot be read (truncated, corrupt) produces a
    ``RuntimeWarning`` and the previous checkpoint is used instead; if neither
    can be read, :class:`CheckpointError` names both.
    """
    path = Path(path)
    candidates = [p for p in (path, previous_path(path)) if p.exists()]
    errors = []
    for candidate in candidates:
        try:
            if not candidate.is_file():  # reading a FIFO would wait forever
                kind = "is a directory" if candidate.is_dir() else "is not a regular file"
                errors.append(f"{candidate}: {kind}")
            else:
                return read_checkpoint_file(candidate, map_location)
        except Exception as exc:  # a truncated pickle raises many kinds of errors
            kind = type(exc).__name__
            errors.append(f"{candidate}: {kind}: {one_line(exc)}")
        note = (f"; the next save keeps it as {candidate}{CORRUPT_SUFFIX}<time>, never as the "
                "fallback" if candidate == path and candidate.is_file() else "")
        warnings.warn(f"checkpoint {candidate} is unreadable ({kind}); trying the previous "
                      f"one{note}", RuntimeWarning, stacklevel=2)
    if errors:
        raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP (state dicts are saved without the ``module.`` prefix)."""
    return getattr(model, "module", model)


def training_state(epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None, **extra: Any) -> dict[str, Any]:
    """Everything needed to continue after ``epoch`` as if nothing had happened."""
    state = {
        "epoch": epoch,
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        **extra,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state


def restore_training_state(state: dict[str, Any], model: nn.Module,
                           optimizer: torch.optim.Optimizer,
                           scaler: torch.amp.GradScaler | None = None) -> int:
    """Load ``state`` into model, optimizer (and scaler); return the epoch to run next."""
    try:
        unwrap(model).load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint does not fit this model: {one_line(exc)}") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint's optimizer state does not fit: {one_line(exc)}") from None
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    # map_location may have moved the RNG states to a GPU; the setters want CPU bytes.
    if "rng_cpu" in state:
        torch.set_rng_state(state["rng_cpu"].cpu())
    cuda_states = state.get("rng_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
    return int(state["epoch"]) + 1


def check_checkpoint_fits(path: str | os.PathLike[str], model: nn.Module) -> int | None:
    """Before a run: the epoch a checkpoint at ``path`` would resume at, or None if none exists.

    Raises :class:`CheckpointError` (one line) when no copy is readable or the
    weights do not fit ``model``; nothing is written.
    """
    state = load_checkpoint(path, map_location="cpu")
    if state is None:
        return None
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this model: {one_line(exc)}") from None
    return int(state["epoch"]) + 1


def check_resumable(path: str | os.PathLike[str], model: nn.Module, *, writer: bool = True) -> int | None:
    """Before a run, the one check of a one-file ``--checkpoint``: the epoch it resumes at, or None.

    The ``writer`` (rank 0) must be able to save at ``path``
    (:func:`check_checkpoint_target`); every rank must be able to read what is
    there, and it must fit ``model`` (:func:`check_checkpoint_fits`). Raises
    :class:`CheckpointError` (one line); nothing is written.
    """
    if writer:
        check_checkpoint_target(path)
    return check_checkpoint_fits(path, model)
