"""Jobs on a running Slurm cluster: submitted with ``sbatch``, read with ``scontrol show job``.

``submit`` runs ``sbatch --parsable`` on node 0 and returns the job id;
:func:`info` reads one job's fields (``JobState``, ``Restarts``, ``NodeList``,
``ExitCode``, ...) from ``scontrol show job -o``, which prints them as
``Key=Value`` on one line; :func:`wait_for` polls them (Slurm has no call that
waits for a job's state) until a condition holds, bounded in time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ddpguide.slurm.scheduler import Slurm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "cluster" / "slurm_torchrun.sbatch"
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def submit(slurm: Slurm, options: list[str], script: Path = RECIPE, args: tuple[str, ...] = (), *,
           cwd: Path, program: Path | None = None, timeout: float = 30.0,
           env: dict[str, str] | None = None) -> str:
    """``sbatch OPTIONS SCRIPT ARGS`` from ``cwd``; the job id. ``program`` (a path) is
    passed to the recipe as ``PROGRAM``, ``env`` added to the job's environment."""
    extra = {**({"PROGRAM": str(program)} if program else {}), **(env or {})}
    done = slurm.run(["sbatch", "--parsable", *options, str(script), *args], timeout, cwd=cwd,
                     extra_env=extra)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch refused the job: {done.errors.strip()}")
    return done.output.strip().split(";")[0]


def parse_show_job(line: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as a dict (a value may hold spaces only in the
    last fields, ``Command=`` and after, which are kept whole)."""
    fields: dict[str, str] = {}
    key = None
    for word in line.strip().split(" "):
        name, sep, value = word.partition("=")
        if sep and name and name[0].isalpha() and name.replace("/", "").replace(":", "").isalnum():
            key = name
            fields[key] = value
        elif key is not None:
            fields[key] += " " + word
    return fields


def info(slurm: Slurm, job: str) -> dict[str, str]:
    """Job ``job``'s fields now; empty when the controller no longer knows it."""
    done = slurm.run(["scontrol", "show", "job", "-o", job], 20)
    return parse_show_job(done.output) if done.returncode == 0 and done.output.strip() else {}


def wait_for(slurm: Slurm, job: str, condition: Callable[[dict[str, str]], bool], timeout: float,
             what: str = "the condition") -> dict[str, str]:
    """Poll job ``job`` until ``condition(fields)`` holds; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        fields = info(slurm, job)
        if fields and condition(fields):
            return fields
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job}: not {what} after {timeout:g} s "
                               f"(state {fields.get('JobState', '?')}, reason {fields.get('Reason', '?')})")
        time.sleep(0.25)


def wait_done(slurm: Slurm, job: str, timeout: float) -> dict[str, str]:
    return wait_for(slurm, job, lambda f: f.get("JobState") in FINISHED, timeout, "finished")


def appears(path: os.PathLike[str] | str, text: str, timeout: float) -> None:
    """Wait until the file ``path`` (a job's output) holds ``text``."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and text in Path(path).read_text(errors="replace")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not in {path} after {timeout:g} s")
        time.sleep(0.1)
