"""A record of every command the runner execs, for :mod:`ddpguide.launch.ran` to check.

While :data:`RAN_VARIABLE` names a folder (``make test`` sets it for the package tests and the
chapters alike), :meth:`ddpguide.launch.ranks.Ranks.start` calls :func:`record` for each
:class:`~ddpguide.launch.ranks.Command` whose words name a Python file: one JSON line in
``<folder>/<pid>.jsonl`` (one file a process: pytest-xdist workers and notebook kernels never
share one) with the command's words (not its prefix, such as ``ip netns exec``), its folder,
the SHA-256 of each ``.py`` file it names (which program it is, the check decides: an edited
copy is not the program), the variables the runner set for it beyond its own environment, and
who ran it (the test, under pytest). Without the variable nothing is read or written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

#: the folder the records go to (unset: nothing is recorded)
RAN_VARIABLE = "DDPGUIDE_RAN"


def record(argv: Sequence[str], cwd: str | os.PathLike | None, env: Mapping[str, str]) -> None:
    """Record that ``argv`` starts in ``cwd`` with ``env`` (see the module's docstring)."""
    folder = os.environ.get(RAN_VARIABLE)
    if not folder:
        return
    files = {}
    for word in argv:
        path = Path(cwd or ".") / word
        if word.endswith(".py") and path.is_file():
            files[word] = hashlib.sha256(path.read_bytes()).hexdigest()
    if not files:
        return
    line = {"argv": list(argv), "cwd": os.path.abspath(cwd or "."), "files": files,
            "env": {k: v for k, v in env.items() if os.environ.get(k) != v},
            "by": os.environ.get("PYTEST_CURRENT_TEST", "")}
    os.makedirs(folder, exist_ok=True)
    fd = os.open(Path(folder, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())  # one O_APPEND write: lines never mix
    finally:
        os.close(fd)
