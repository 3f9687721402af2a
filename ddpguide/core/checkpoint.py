"""Checkpoints that survive crashes: atomic writes, a fallback copy, safe loading.

The rules, each for a reason:

* only rank 0 writes (every rank holds the same weights; N writers race);
* write to a temporary file in the same directory, flush and fsync, then
  ``os.replace`` it over the old one: a reader sees the old file or the new
  one, never half of one, whenever the writer is killed;
* keep the previous checkpoint, so a corrupt or truncated latest one falls
  back to it with a warning;
* load with ``map_location`` (a GPU checkpoint loads on CPU and vice versa) and
  ``weights_only=True`` (a checkpoint is a pickle; loading must never run code);
* resume at the epoch *after* the saved one: never repeat or skip an epoch.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

PREVIOUS_SUFFIX = ".prev"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the model."""


def previous_path(path: str | os.PathLike) -> Path:
    """Where the checkpoint before the latest one is kept."""
    path = Path(path)
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two names are links to one file.

    A writer killed between keeping the fallback and moving the new file in
    leaves ``path`` and ``path.prev`` as two links to the same file: that file
    already is the fallback, and the next save must not link it again.
    """
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _temp_prefix(path: Path) -> str:
    # Host and pid in the name let a later save recognise leftovers of a killed writer.
    return f".{path.name}.{socket.gethostname()}.{os.getpid()}."


def _remove_stale_temporaries(path: Path) -> None:
    """Delete temporary files of writers on this host that no longer run."""
    host_prefix = f".{path.name}.{socket.gethostname()}."
    for candidate in path.parent.glob(f".{path.name}.*.tmp"):
        rest = candidate.name[len(host_prefix):] if candidate.name.startswith(host_prefix) else ""
        pid = rest.split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            candidate.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, owned by someone else


def check_writable_directory(path: str | os.PathLike) -> Path:
    """Raise :class:`CheckpointError` unless a checkpoint can be created next to ``path``.

    Creates and removes a probe file: ``os.access`` says yes to root even on a
    read-only file system.
    """
    directory = Path(path).parent
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} is not writable "
                              f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return directory


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Atomically write ``state`` to ``path``, keeping the old file as ``path.prev``.

    Killed at any instant, this leaves ``path`` either as it was or complete
    with the new state; never missing, never half-written.
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    _remove_stale_temporaries(path)
    prefix = _temp_prefix(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} is not writable "
                              f"({exc.strerror or exc})") from None
    link_name = None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        previous = previous_path(path)
        if path.exists() and not _same_file(path, previous):
            # Keep the current file as the fallback without a moment in which
            # `path` is missing: hard-link (or copy) it under a private name,
            # then move that into place.
            link_name = f"{directory}/{prefix}prev.tmp"
            Path(link_name).unlink(missing_ok=True)  # never copy through an old link
            try:
                os.link(path, link_name)
            except OSError:  # file systems without hard links
                shutil.copyfile(path, link_name)
            os.replace(link_name, previous)
            # rename(2) does nothing when both names are links to one file; the
            # check above rules that out, and this makes sure no name is left.
            Path(link_name).unlink(missing_ok=True)
            link_name = None
        os.replace(tmp_name, path)
        _fsync_dir(directory)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        if link_name:
            Path(link_name).unlink(missing_ok=True)
        raise
    return path


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message folded onto one line (state-dict errors span several)."""
    text = " ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
        raise CheckpointError(f"{path} is not a training checkpoint (no 'epoch'/'model' entry)")
    return state


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any] | None:
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
            state = _read(candidate, map_location)
        except Exception as exc:  # a truncated pickle raises many kinds of errors
            errors.append(f"{candidate}: {type(exc).__name__}: {_one_line(exc)}")
            warnings.warn(f"checkpoint {candidate} is unreadable ({type(exc).__name__}); "
                          "trying the previous one", RuntimeWarning, stacklevel=2)
            continue
        return state
    if errors:
        raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP (state dicts are saved without the ``module.`` prefix)."""
    return getattr(model, "module", model)


def training_state(epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: "torch.amp.GradScaler | None" = None, **extra: Any) -> dict[str, Any]:
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
                           scaler: "torch.amp.GradScaler | None" = None) -> int:
    """Load ``state`` into model, optimizer (and scaler); return the epoch to run next."""
    try:
        unwrap(model).load_state_dict(state["model"])
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint does not fit this model: {_one_line(exc)}") from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint's optimizer state does not fit: {_one_line(exc)}") from None
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    # map_location may have moved the RNG states to a GPU; the setters want CPU bytes.
    if "rng_cpu" in state:
        torch.set_rng_state(state["rng_cpu"].cpu())
    cuda_states = state.get("rng_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
    return int(state["epoch"]) + 1


def check_checkpoint_fits(path: str | os.PathLike, model: nn.Module) -> int | None:
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
        raise CheckpointError(f"checkpoint {path} does not fit this model: {_one_line(exc)}") from None
    return int(state["epoch"]) + 1
