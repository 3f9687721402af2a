"""Start JupyterLab on the chapters: ``make lab`` (extra arguments: ``LAB_ARGS=...``).

The server's root is ``book/``, so a chapter's kernel starts there, as in the
book build and in nbmake. The kernel is this virtual environment's Python,
where ``ddpguide`` is installed (``pip install -e .``), so chapters import it.
As root (containers, CI machines) JupyterLab refuses to start without
``--allow-root``.

``tests/test_lab_execution.py`` starts the server with :func:`lab_command`,
so the test and ``make lab`` cannot drift apart.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
BOOK = ROOT / "book"


def lab_command(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line of ``make lab``, with ``extra`` arguments appended."""
    jupyter = Path(sys.executable).with_name("jupyter")
    command = [str(jupyter), "lab", f"--notebook-dir={BOOK}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    return command + list(extra)


def main(argv: list[str]) -> int:
    command = lab_command(argv)
    print(" ".join(command), flush=True)
    os.execv(command[0], command)
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
