"""Every process the cluster package starts is started here, bounded in time.

:func:`run_all` starts commands side by side (each usually prefixed with
``ip netns exec NODE``), waits for all of them up to one deadline, and on a
failure of any (or the deadline, or Ctrl-C) stops every process tree it
started, so that one dead rank never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ddpguide.core.processes import descendants, signal_all


@dataclass
class Finished:
    """One command's end: its exit status (None: stopped at the deadline), output, seconds."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def stop_tree(proc: subprocess.Popen[str], grace: float = 3.0) -> None:
    """SIGTERM the process, its group and everything below it; SIGKILL after ``grace``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tree = [proc.pid, *descendants(proc.pid)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        signal_all(tree, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_all(commands: list[list[str]], timeout: float, *, env: list[dict[str, str]] | None = None,
            cwd: str | Path | None = None, fail_fast: bool = True,
            capture: bool = True) -> list[Finished]:
    """Run ``commands`` side by side; every one is done, or stopped, within ``timeout`` s.

    With ``fail_fast``, the first non-zero exit stops the others. Output is
    captured (``capture``) or passes through to this process's own streams.
    """
    started = time.monotonic()
    deadline = started + timeout
    procs: list[subprocess.Popen[str]] = []
    outs: list[tuple[str, str] | None] = [None] * len(commands)
    ended: list[float | None] = [None] * len(commands)
    pipe = subprocess.PIPE if capture else None
    try:
        for k, argv in enumerate(commands):
            procs.append(subprocess.Popen(
                argv, env=None if env is None else env[k], cwd=cwd, text=True,
                stdout=pipe, stderr=pipe, start_new_session=True))
        failed = False
        while any(e is None for e in ended) and not failed and time.monotonic() < deadline:
            for k, proc in enumerate(procs):
                if ended[k] is not None:
                    continue
                if capture:
                    try:
                        outs[k] = proc.communicate(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        continue
                elif proc.poll() is None:
                    time.sleep(0.05 / len(procs))
                    continue
                ended[k] = time.monotonic() - started
                failed = failed or (fail_fast and proc.returncode != 0)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_tree(proc)
        for k, proc in enumerate(procs):
            if capture and outs[k] is None:
                with contextlib.suppress(Exception):
                    outs[k] = proc.communicate(timeout=2)
    results = []
    for k, argv in enumerate(commands):
        out, err = outs[k] or ("", "")
        seconds = ended[k]
        results.append(Finished(argv, procs[k].returncode if seconds is not None else None,
                                out or "", err or "",
                                time.monotonic() - started if seconds is None else seconds))
    return results
