"""A program edited as a reader might edit it, for the tests that show a check failing.

The edit is made on a copy (:func:`ddpguide.launch.programs.copy_program`), never on the
program: a test plants an error in the chapter's own code and sees the check catch it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddpguide.launch.programs import copy_program


def edited_copy(name: str, folder: str | os.PathLike, *edits: tuple[str, str], count: int = 1) -> Path:
    """A copy of program ``name`` in ``folder`` with each ``(old, new)`` replaced; ``old`` must
    occur ``count`` times, so that an edit never silently misses."""
    path = copy_program(name, folder)
    text = path.read_text()
    for old, new in edits:
        if text.count(old) != count:
            raise ValueError(f"{name}: {old!r} occurs {text.count(old)} times, not {count}")
        text = text.replace(old, new)
    path.write_text(text)
    return path
