"""Running ``python -m ddpguide.doctor`` from tests: bounded, and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Start-up on a loaded 2-core machine: the interpreter, torch, and a few retries.
STARTUP_ALLOWANCE_S = 90.0
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                      "SLURM_NTASKS", "SLURM_PROCID")


@dataclass
class Finished:
    """One process: exit status, output, wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without launcher variables, the worktree first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def start(argv: list[str], extra_env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start a command in a session of its own (so its whole tree can be stopped)."""
    return subprocess.Popen(argv, env=environment(extra_env), cwd=cwd or ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(processes: list[subprocess.Popen], timeout_s: float) -> list[Finished]:
    """Wait for all, at most ``timeout_s``; then stop each one's process group."""
    started = time.monotonic()
    results = []
    try:
        for process in processes:
            try:
                out, err = process.communicate(timeout=max(0.1, started + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                out, err = process.communicate()
                raise AssertionError(f"{process.args} did not finish within {timeout_s} s:\n{out}\n{err}") from None
            results.append(Finished(process.returncode, out, err, time.monotonic() - started))
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # ranks a parent may have left
            except (ProcessLookupError, PermissionError):
                pass
            if process.poll() is None:
                process.wait()
    return results


def doctor(args: list[str], extra_env: dict[str, str] | None = None,
           timeout_s: float = STARTUP_ALLOWANCE_S + 60) -> Finished:
    """``python -m ddpguide.doctor ARGS`` to its end."""
    return finish([start([sys.executable, "-m", "ddpguide.doctor", *args], extra_env)], timeout_s)[0]


def by_hand(ranks: list[dict[str, str]], args: list[str], timeout_s: float) -> list[Finished]:
    """One doctor process per environment in ``ranks``, as a user would start them by hand."""
    processes = [start([sys.executable, "-m", "ddpguide.doctor", *args], env) for env in ranks]
    return finish(processes, timeout_s)
