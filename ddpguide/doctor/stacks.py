"""Where is each rank of a hung job? Find the workers and ask py-spy for their Python stacks.

``py-spy dump --pid PID`` reads another process's Python stack without
stopping it for long and without any change to the program. It needs
permission to trace the process (ptrace): as root, or with
``kernel.yama.ptrace_scope`` 0, or ``CAP_SYS_PTRACE`` in a container. When it
cannot attach, :func:`dump_stack` returns py-spy's own message instead of
raising, so a caller can say so and go on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

#: Terminal colour codes (a notebook kernel asks programs for colour, and py-spy obliges).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def find_workers(variable: str, value: str) -> dict[int, int]:
    """Global rank -> pid of the live workers whose environment has ``variable=value``.

    A launcher's workers carry ``RANK``; the launcher itself does not, so it is
    left out. Linux only (/proc); an empty dict elsewhere.
    """
    workers = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = _environ_of(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if environ.get(variable) == value and "RANK" in environ:
            workers[int(environ["RANK"])] = int(entry.name)
    return dict(sorted(workers.items()))


def marked_processes(variable: str, value: str) -> list[int]:
    """Every live process whose environment has ``variable=value``: workers, their launcher,
    and what they started (a forked helper carries the marker too). Linux only (/proc)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if _environ_of(int(entry.name)).get(variable) == value:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return sorted(found)


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (a virtual environment), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stack(pid: int, timeout_s: float = 20.0) -> tuple[bool, str]:
    """``py-spy dump --pid PID``: (True, the stack) or (False, why it could not)."""
    executable = py_spy()
    if executable is None:
        return False, "py-spy is not installed (pip install py-spy)"
    env = {k: v for k, v in os.environ.items() if k not in ("CLICOLOR_FORCE", "FORCE_COLOR")}
    env.update(NO_COLOR="1", TERM="dumb")
    try:
        done = subprocess.run([executable, "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return False, f"py-spy did not answer within {timeout_s:g} s"
    if done.returncode != 0:
        why = _ANSI.sub("", done.stderr or done.stdout).strip()
        return False, why or f"py-spy exited with {done.returncode}"
    return True, _ANSI.sub("", done.stdout)


def debug_server_page(url: str, timeout_s: float = 20.0) -> list[tuple[str, str]] | None:
    """One page of ``torch.distributed.debug``'s debug server as (heading, text) per rank.

    The server answers with HTML: an ``<h2>`` naming each rank's worker, then its
    data in a ``<pre>``. Returns None while nothing answers at ``url``.
    """
    import html
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            page = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None
    sections = re.findall(r"<h2>(.*?)</h2>\s*(?:<pre>(.*?)</pre>)?", page, re.S)
    return [(html.unescape(head).strip(), html.unescape(body)) for head, body in sections]
