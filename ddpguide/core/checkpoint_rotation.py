"""The file side of checkpoints: atomic replace, a fallback that only moves forward.

:func:`save_checkpoint` writes the new state beside the old one, reads it
back, then moves it into place with ``os.replace``. The file it replaces
becomes the fallback (``path.prev``) only if it is a checkpoint that was read
back, by this process or just now; a file that cannot be read is kept aside
as ``path.corrupt-<time>`` and the fallback stays as it was. So the fallback
is always a state that loads, and a damaged latest file never costs it.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ddpguide.core.commands import one_line

PREVIOUS_SUFFIX = ".prev"
CORRUPT_SUFFIX = ".corrupt-"
# Identities (device, inode, size, mtime) of files this process read back as
# checkpoints: such a file need not be read again before it becomes the fallback.
_read_back: dict[tuple[int, int, int, int], None] = {}
_READ_BACK_KEPT = 64


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the model."""


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the checkpoint before the latest one is kept."""
    path = Path(path)
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def kept_aside(path: str | os.PathLike[str]) -> list[Path]:
    """Unreadable files a save kept aside instead of making them the fallback, by name."""
    path = Path(path)
    return sorted(path.parent.glob(glob.escape(path.name + CORRUPT_SUFFIX) + "*"))


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


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


def check_writable_directory(path: str | os.PathLike[str]) -> Path:
    """Raise :class:`CheckpointError` unless a checkpoint can be created next to ``path``.

    Creates and removes a probe file: ``os.access`` says yes to root even on a
    read-only file system.
    """
    directory = Path(path).parent
    if not directory.exists():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)
    except OSError as exc:
        raise CheckpointError(f"checkpoint directory {directory} is not writable "
                              f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return directory


def check_checkpoint_target(path: str | os.PathLike[str]) -> Path:
    """Raise :class:`CheckpointError` unless a checkpoint can be saved at ``path``.

    Its directory must exist and take new files; neither ``path`` nor its
    fallback name may be a directory or anything but a regular file. Creates
    nothing (the probe file is removed). Returns the directory.
    """
    path = Path(path)
    directory = path.parent
    if directory.is_dir():
        for name, what in ((path, "checkpoint"), (previous_path(path), "checkpoint fallback")):
            if name.is_dir():
                raise CheckpointError(f"{what} {name} is a directory")
            if name.exists() and not name.is_file():
                raise CheckpointError(f"{what} {name} is not a regular file")
    return check_writable_directory(path)


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
        got = f"keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"a training checkpoint is a dict with 'epoch' and 'model' "
                              f"entries, got {got}")


def _unreadable(path: Path) -> str | None:
    """Why ``path`` may not become the fallback (None: it was read back as a checkpoint)."""
    identity = _identity(path)
    if identity is not None and identity in _read_back:
        return None
    try:
        read_checkpoint_file(path, "cpu")
    except Exception as exc:  # a damaged pickle raises many kinds of errors
        return type(exc).__name__
    return None


def _keep_aside(path: Path) -> Path:
    """Keep ``path`` under a new name that says it is damaged; ``path`` stays in place."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in itertools.count():
        aside = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{stamp}" + (f"-{n}" if n else ""))
        try:
            os.link(path, aside)  # never replaces a file kept earlier
            return aside
        except FileExistsError:
            continue
        except OSError:  # file systems without hard links
            if not aside.exists():
                shutil.copyfile(path, aside)
                return aside
    raise AssertionError("unreachable")


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Atomically write ``state`` to ``path``, keeping the old file as ``path.prev``.

    Killed at any instant, this leaves ``path`` either as it was or complete
    with the new state; never missing, never half-written. The new file is
    read back before it replaces anything; the old one becomes ``path.prev``
    only if it is a checkpoint that was read back, else it is kept aside as
    ``path.corrupt-<time>`` (with a warning) and ``path.prev`` stays as it is.
    """
    path = Path(path)
    _check_state(state)
    directory = check_checkpoint_target(path)
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
        try:
            read_checkpoint_file(Path(tmp_name), "cpu")
        except Exception as exc:
            raise CheckpointError(f"checkpoint for {path} could not be read back, nothing was "
                                  f"replaced: {type(exc).__name__}: {one_line(exc)}") from None
        previous = previous_path(path)
        reason = _unreadable(path) if path.exists() else None
        if reason is not None:
            aside = _keep_aside(path)
            if _same_file(path, previous):  # a damaged file is no fallback under any name
                previous.unlink()
                kept = f"{previous} named it too and is removed"
            else:
                kept = f"{previous} is unchanged" if previous.exists() else "no fallback is kept"
            warnings.warn(f"checkpoint {path} is unreadable ({reason}): kept as {aside}, not as the "
                          f"fallback ({kept})", RuntimeWarning, stacklevel=2)
        elif path.exists() and not _same_file(path, previous):
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


def read_checkpoint_file(path: Path, map_location: Any) -> dict[str, Any]:
    """Load one checkpoint file (weights only); remember the file as read back if it did not change meanwhile."""
    before = _identity(path)
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
        raise CheckpointError(f"{path} is not a training checkpoint (no 'epoch'/'model' entry)")
    if before is not None and _identity(path) == before:
        _read_back[before] = None
        while len(_read_back) > _READ_BACK_KEPT:
            del _read_back[next(iter(_read_back))]
    return state
