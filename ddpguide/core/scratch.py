"""The temporary folders the package makes on its own: one home for them.

:func:`folder` makes one (``tempfile.mkdtemp``) and removes it when this interpreter exits,
unless :func:`remove` removed it before. Whatever reads the folder in the meantime (a chapter
reading what a program wrote) can; a process forked from this one never removes its
parent's folders (each folder is removed only by the process that made it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

#: folder -> the id of the process that made it
_MADE: dict[Path, int] = {}


def folder(prefix: str) -> Path:
    """A new, empty folder (name starting with ``prefix``), removed at this interpreter's exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _MADE[path] = os.getpid()
    return path


def remove(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` and everything in it now (gone already: nothing to do)."""
    _MADE.pop(Path(path), None)
    shutil.rmtree(path, ignore_errors=True)


def pending() -> list[Path]:
    """The folders this process made that are still to be removed at its exit."""
    return [path for path, pid in _MADE.items() if pid == os.getpid()]


@atexit.register
def _remove_all() -> None:
    for path in pending():
        remove(path)
