"""The book's standalone programs (``book/programs/``), shown and run from a chapter.

A chapter shows a program in full with :func:`show`, runs it with the command a
reader would type with :func:`run` (in a fresh folder that holds only a copy of
the program, as a reader who copied it would; its lines appear in the cell as
they are printed), and shows the change from one program to the next with
:func:`diff`. A check that needs the program's own classes or plans imports it
with :func:`load`: the package keeps no copy of a program's model. Every run is
bounded: at the time limit the program and every process below it are killed
(:mod:`ddpguide.launch.ranks`) and :class:`ProgramTimeout` raised.

``launch="warm"`` (the package tests' default, :data:`LAUNCH`) forks the ranks of a
``python`` or standalone ``torchrun`` command from the warm server instead
(:mod:`ddpguide.launch.forked`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Sequence

from ddpguide.core import scratch
from ddpguide.launch import forked, ranks, starts
from ddpguide.launch import report as reports

#: Where the programs live in a checkout.
PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
#: How :func:`run` starts a command by default: ``"typed"`` (as a reader types it),
#: ``"warm"`` (ranks forked warm where they can be) or ``"typed-once"`` (a program's first
#: run in this process typed, so that its ranks go through interpreter teardown once, the
#: later ones warm: the package tests' setting)
LAUNCH = "typed"
LAUNCHES = ("typed", "warm", "typed-once")
#: the programs that have run as typed in this process
TYPED: set[str] = set()
#: the programs (file names, as :data:`TYPED`) whose ``Run:`` line's command has run as typed
#: in this process
RUN_LINES: set[str] = set()

#: The file ``run(..., report=True)`` asks the program to write, in its folder.
REPORT = "report.json"

#: torchrun's own log lines: ``W1201 04:53:33.603000 6362 torch/distributed/run.py:982] ...``
#: on a terminal, and its OMP_NUM_THREADS notice and the rows of stars around it, which come
#: without that prefix otherwise.
_TORCHRUN_LOG = re.compile(r"^(?:[DIWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]|Setting OMP_NUM_THREADS |\*{20,}$)")


class ProgramTimeout(TimeoutError):
    """The program did not finish in time; all its processes were killed."""


class ProgramFailed(RuntimeError):
    """The program exited with a status other than the one expected."""


@dataclass
class ProgramRun:
    """What one run of a program printed, and how it ended."""

    command: str
    returncode: int
    output: str
    seconds: float
    workdir: Path
    #: what the program wrote with ``--report`` (``run(..., report=True)``), else None
    report: dict | None = None

    def lines(self) -> list[str]:
        return self.output.splitlines()

    def program_lines(self) -> list[str]:
        """What the program printed, without torchrun's own log lines."""
        return [line for line in self.lines() if not _TORCHRUN_LOG.match(line)]

    def reported(self) -> dict:
        """:attr:`report`; :class:`~ddpguide.launch.report.ReportError` (one line) for a run that
        has none (run without ``report=True``, or one that failed before it wrote one)."""
        if self.report is None:
            raise reports.ReportError(f"`{self.command}` (exit status {self.returncode}): no report")
        return self.report

    def text(self) -> str:
        """The command, what the program printed, and how it ended, as a terminal shows it."""
        return "\n".join([f"$ {self.command}", *self.program_lines(),
                          f"(exit status {self.returncode}, {self.seconds:.1f} s)"])


def torchrun(nproc: int) -> tuple[str, ...]:
    """The launcher a reader types for ``nproc`` local workers (``run(..., launcher=...)``)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return ("torchrun", "--standalone", f"--nproc-per-node={nproc}")


def path_of(name: str) -> Path:
    """The program ``name`` (``ddp_spawn.py``, or a path below ``book/programs``)."""
    path = PROGRAMS / name
    if not path.is_file():
        raise FileNotFoundError(f"no program {name!r} in {PROGRAMS}")
    return path


def load(name: str | os.PathLike) -> ModuleType:
    """Import program ``name`` (below ``book/programs/``; or a ``Path``) as a module; its ``main`` does not run.

    Each call imports the file afresh, so an edited program is what a check
    sees; the module is named ``program_<stem>`` (never its own bare name,
    which could shadow a library module). A program that sets torch's default
    dtype when imported (``zero1.py``, ``fsdp2.py``, ``zero3_by_hand.py`` choose
    float64) sets it for its own process only: the importer's default is
    restored, so loading a program never changes the dtype of later code. A program that imports
    a neighbour (``import plan_cost``, as run from its folder) gets that neighbour afresh too; the
    folder is on ``sys.path`` and the neighbours in ``sys.modules`` only while it is imported.
    """
    path = Path(name) if isinstance(name, os.PathLike) or os.path.isabs(name) else path_of(name)
    spec = importlib.util.spec_from_file_location(f"program_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no program at {path}")
    import torch  # here: showing and running programs needs no torch in this process

    module = importlib.util.module_from_spec(spec)
    default_dtype = torch.get_default_dtype()
    neighbours = {part.stem for part in path.parent.glob("*.py")}
    saved = {name: sys.modules.pop(name) for name in neighbours if name in sys.modules}
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        for name in neighbours:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        torch.set_default_dtype(default_dtype)
    return module


def show(name: str):
    """The program in full, highlighted (in JupyterLab and in the HTML book)."""
    from IPython.display import Code

    return Code(filename=str(path_of(name)), language="python")


def diff(old: str, new: str, context: int = 2) -> str:
    """The unified diff from one program to another, computed, not typed."""
    a, b = path_of(old), path_of(new)
    return "".join(difflib.unified_diff(
        a.read_text().splitlines(keepends=True), b.read_text().splitlines(keepends=True),
        fromfile=old, tofile=new, n=context))


def show_diff(old: str, new: str, context: int = 2):
    """:func:`diff`, highlighted."""
    from IPython.display import Code

    return Code(diff(old, new, context), language="diff")


def copy_program(name: str, folder: str | os.PathLike) -> Path:
    """Copy program ``name`` into ``folder`` (made if need be), with its neighbours when it is
    a program of several files in a folder of its own (``gpt/train.py``); return the copy."""
    source, folder = path_of(name), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for part in source.parent.glob("*.py") if source.parent != PROGRAMS else [source]:
        shutil.copy(part, folder / part.name)
    return folder / source.name


def launch_of(name: str, launch: str | None = None, run_line: bool = False) -> str:
    """``"typed"`` or ``"warm"``: how program ``name`` runs now under ``launch`` (None:
    :data:`LAUNCH`); whoever runs it typed adds it to :data:`TYPED`. Under ``"typed-once"``
    the command of the program's ``Run:`` line (``run_line``) runs typed too, the first time
    it comes, whatever ran before it, so that ``make test``'s check that each program ran as
    its ``Run:`` line types it (:mod:`ddpguide.launch.ran`) does not depend on the tests' order."""
    launch = LAUNCH if launch is None else launch
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {', '.join(LAUNCHES)}, got {launch!r}")
    if launch == "typed-once":
        typed_now = run_line and Path(name).name not in RUN_LINES
        return "warm" if Path(name).name in TYPED and not typed_now else "typed"
    return launch


def run(name: str, *args: str, launcher: Sequence[str] = ("python",), timeout: float = 120.0,
        expect: int | None = 0, echo: bool = True, env: dict[str, str] | None = None,
        workdir: str | os.PathLike | None = None, launch: str | None = None,
        report: bool = False) -> ProgramRun:
    """Run ``<launcher> <name> <args>`` in a folder holding a copy of the program.

    ``launcher`` is what the reader types before the file name: ``("python",)``
    or ``("torchrun", "--standalone", "--nproc-per-node=2")``. ``expect`` is the
    exit status the chapter expects (None: any). The folder (``workdir``, or a new one)
    is kept, so a chapter can read what the program wrote (``ProgramRun.workdir``); a new
    one is removed when this interpreter exits (:mod:`ddpguide.core.scratch`). ``launch``: see
    :data:`LAUNCH` (None: that default). With ``report`` the
    command ends with ``--report report.json`` (in that folder) and ``ProgramRun.report`` is
    what the program wrote there (:mod:`ddpguide.launch.report`): required after exit
    status 0, read if present after another.
    """
    source = path_of(name)
    command = [*launcher, source.name, *args, *(("--report", REPORT) if report else ())]
    run_line = starts.is_run_line(source, command, env or {}, str(workdir or ""))
    launch = launch_of(name, launch, run_line)
    folder = Path(workdir) if workdir else scratch.folder("ddpguide-program-")
    copy_program(name, folder)
    report_path = folder / REPORT
    report_path.unlink(missing_ok=True)  # a report from an earlier run in this folder is not this one's
    shown = " ".join(shlex.quote(part) for part in command)
    if echo:
        print(f"$ {shown}", flush=True)
    started = time.monotonic()
    nproc = forked.ranks_of(launcher) if launch == "warm" else None
    done = None if nproc is None else forked.run(
        folder, command[len(launcher):], nproc, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        timeout, (lambda text: print(text, end="", flush=True)) if echo else None)
    if done is None:  # the command as typed
        done = _run_command(command, folder, env or {}, timeout, echo)
        TYPED.add(source.name)
        if run_line:
            RUN_LINES.add(source.name)
    seconds = time.monotonic() - started
    if done.timed_out:
        raise ProgramTimeout(f"`{shown}` did not finish within {timeout:g} s and was stopped")
    if expect is not None and done.returncode != expect:
        tail = "\n".join(done.output.splitlines()[-30:])
        raise ProgramFailed(f"`{shown}` exited with {done.returncode} (expected {expect}):\n{tail}")
    found = None
    if report and (done.returncode == 0 or report_path.exists()):
        found = reports.read(report_path, f"`{shown}`")
    return ProgramRun(shown, done.returncode, done.output, seconds, folder, found)


def _run_command(command: list[str], folder: Path, env: dict[str, str], timeout: float,
                 echo: bool) -> ranks.Ended:
    """``command`` in ``folder``, as a reader types it (``python`` and ``torchrun`` are this
    interpreter's), its output echoed line by line; killed with all its processes at ``timeout``."""
    executable = {"python": [sys.executable],
                  "torchrun": [sys.executable, "-m", "torch.distributed.run"]}
    argv = [*executable.get(command[0], [command[0]]), *command[1:]]
    rank = ranks.Command(argv, {"PYTHONUNBUFFERED": "1", **env}, cwd=folder)
    return ranks.run([rank], timeout, (lambda text: print(text, end="", flush=True)) if echo else None)
