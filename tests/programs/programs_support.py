"""Run a book program the way a reader does: alone in an empty folder, with the chapter's command.

Every run is bounded in time (``ddpguide.launch.ranks``). Each process it starts (the
program, its spawned ranks, torchrun agents and the workers they start in sessions of
their own) carries the runner's launch marker in its environment, and everything with the
marker is killed when the run ends, however it ends. A program's first run in the test
process is typed, later ones forked warm (``programs.launch_of``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from ddpguide.core.runtime import LAUNCHER_VARIABLES
from ddpguide.launch import forked, programs, ranks, starts
from ddpguide.launch.torchrun import LAUNCH_ID_VARIABLE

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def copy_program(name: str, folder: Path) -> Path:
    """Copy ``book/programs/<name>`` alone into ``folder`` (which must not hold another program)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(PROGRAMS / name, folder / name))


def load_program(path: Path) -> ModuleType:
    """Import a copied program as a module (its ``__main__`` block does not run)."""
    return programs.load(path)


def reader_environment(launch_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A shell's environment: no launcher variables, no PYTHONPATH pointing at the package.

    PYTHONUNBUFFERED is left out too: unbuffered, print() writes a line and its newline
    separately, and the lines of two ranks sharing a pipe can interleave.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in (*LAUNCHER_VARIABLES, "PYTHONPATH", "PYTHONUNBUFFERED")}
    env.update({LAUNCH_ID_VARIABLE: launch_id, **(extra or {})})
    return env


def run_line(argv: list[str], cwd: Path, env: dict[str, str] | None) -> bool:
    """Whether ``argv`` in ``cwd`` is its program's ``Run:`` line (``programs.launch_of``)."""
    at = next((i for i, part in enumerate(argv) if part.endswith(".py")), None)
    return at is not None and (cwd / argv[at]).is_file() and starts.is_run_line(
        cwd / argv[at], argv, env or {}, str(cwd))


def forkable(argv: list[str], run_line: bool = False) -> tuple[int, list[str]] | None:
    """``(ranks, [program, *args])`` when forked ranks can stand for ``argv``
    (``ddpguide.launch.forked``): ``PYTHON prog.py ...`` or ``TORCHRUN --standalone
    --nproc-per-node=N prog.py ...``; else None."""
    at = next((i for i, part in enumerate(argv) if part.endswith(".py")), None)
    if at is None or programs.launch_of(argv[at], run_line=run_line) != "warm":
        return None
    names = {PYTHON: "python", TORCHRUN: "torchrun"}
    nproc = forked.ranks_of([names.get(argv[0], argv[0]), *argv[1:at]])
    return None if nproc is None else (nproc, argv[at:])


def run(argv: list[str], cwd: Path, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` to its end, at most ``timeout`` s; fail the test (all killed) past that.

    Its ranks are forked warm when they can be and the test is not marked ``typed``
    (``tests/conftest.py``)."""
    began = time.monotonic()
    typed_line = run_line(argv, cwd, env)
    program = forkable(argv, typed_line)
    done = None if program is None else forked.run(
        cwd, program[1], program[0], reader_environment(uuid.uuid4().hex, env), timeout,
        separate_errors=True)
    if done is None:
        done = ranks.run([ranks.Command(argv, base_env=reader_environment("", env), cwd=cwd)],
                         timeout, separate_errors=True)
        programs.TYPED.update(part for part in argv if part.endswith(".py"))
        programs.RUN_LINES.update(Path(part).name for part in argv if part.endswith(".py") and typed_line)
    if done.timed_out:
        pytest.fail(f"{' '.join(argv)} ran past {timeout} s\n--- stdout\n{done.output[-3000:]}"
                    f"\n--- stderr\n{(done.errors or '')[-3000:]}")
    code = done.returncodes[0] if program is None else done.returncode
    result = subprocess.CompletedProcess(argv, code, done.output, done.errors)
    result.seconds = time.monotonic() - began
    return result


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the run's output unless it exited 0."""
    assert result.returncode == 0, (f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
                                    f"\n--- stderr\n{result.stderr[-3000:]}")
    return result


def files_in(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its content (to prove nothing was written)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def parse_error(path: Path, args: list[str], monkeypatch, capsys,
                check: str = "parse_args") -> str:
    """Call the program's argument check in this process with ``args``; return its stderr.

    The check is the first thing a program runs, before it starts a process or
    writes a file; it must exit with status 2 and print nothing on stdout.
    """
    program = load_program(path)
    monkeypatch.chdir(path.parent)
    monkeypatch.setattr(sys, "argv", [path.name, *args])
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stopped:
        getattr(program, check)()
    captured = capsys.readouterr()
    assert (stopped.value.code, captured.out) == (2, "")
    return captured.err
