"""Which of the book's programs ran as a reader types them: the check of the runner's records.

Every command the runner execs is recorded while :data:`~ddpguide.launch.starts.RAN_VARIABLE`
names a folder (:mod:`ddpguide.launch.starts`); a record is a start of a program when one of
the files it names is, byte for byte, a program of ``book/programs/``. Forked ranks
(:mod:`ddpguide.launch.forked`) are not typed and are not recorded.

Checking: ``python -m ddpguide.launch.ran FOLDER`` reads the first command of each program's
``Run:`` line (continued by a trailing backslash, ended by two spaces: what follows is a
comment) and exits 1, one line per program, when no record holds exactly that command; a
program whose docstring has no ``Run:`` line is not checked. A variable the line sets
(``NAME=value`` in front) must be one the runner set for the command, with that value. What
must differ between a
reader's terminal and a test is normalised on both sides, and nothing else:

* ``--option=value`` is the two words ``--option value``;
* the interpreter is ``python``; ``python -m torch.distributed.run`` is ``torchrun``;
* the program's path is its file name (the reader runs it from its folder);
* a ``HOST:PORT`` word has its port replaced by ``PORT`` (tests take free ports);
* an absolute path is relative to the command's folder when inside it, else its file name
  (a test's temporary folder); ``$PWD/`` in what the reader types is the command's folder;
* torchrun's ``--log-dir`` the runner adds (:meth:`torchrun.Agent.argv`, first among
  torchrun's options; torchrun takes the last one given) is left out: every ``--log-dir``
  but the last; a ``--log-dir`` given once is left out when it is outside the command's
  folder (the runner's; the reader's own follows it and counts, as a path above);
* one ``--report FILE`` among the program's options (after its path) is left out of a
  recorded command whose Run: line has none. It is the package's channel to read the result
  of exactly that run (:mod:`ddpguide.launch.report`: the program writes the file and
  computes nothing else differently), so the run is still the one the line types. No other
  added option is: ``--out FILE``, ``--epochs 1`` or ``--report`` twice make another command.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from ddpguide.launch import starts
from ddpguide.launch.programs import PROGRAMS
from ddpguide.launch.starts import RAN_VARIABLE


@functools.cache
def _paths() -> dict[str, Path]:
    """Every program: its path below ``book/programs`` -> its file."""
    return {path.relative_to(PROGRAMS).as_posix(): path for path in sorted(PROGRAMS.rglob("*.py"))}


@functools.cache
def _programs() -> dict[str, str]:
    """The SHA-256 of every program's bytes -> its path below ``book/programs``."""
    return {hashlib.sha256(path.read_bytes()).hexdigest(): name for name, path in _paths().items()}


def records(folder: str | os.PathLike) -> list[dict]:
    """Every start of a program recorded in ``folder``: the record, with ``program`` (its path
    below ``book/programs``) and ``words`` (the command as a reader's words) added."""
    found = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            start = json.loads(line) if line.endswith("}") else {"files": {}}
            word = next((w for w, digest in start["files"].items() if digest in _programs()), None)
            if word is not None:
                found.append({**start, "program": _programs()[start["files"][word]],
                              "words": starts.words(start["argv"], start["cwd"], word)})
    return found


def not_run_as_typed(folder: str | os.PathLike, programs: Sequence[str] | None = None) -> list[str]:
    """One line for each program (``programs``: those, else every program with a ``Run:`` line)
    that no record in ``folder`` shows run with its ``Run:`` line's command."""
    ran = records(folder)
    problems = []
    for name in programs if programs is not None else _paths():
        typed = starts.run_line(_paths()[name])
        if typed is None:
            continue
        env, command = typed
        names = [a.partition("=")[0] for a in env]
        of_it = [r for r in ran if r["program"] == name]
        if any(starts.is_run_line(_paths()[name], r["argv"], r["env"], r["cwd"]) for r in of_it):
            continue
        shown = " ".join([*env, *command])
        near = [r for r in of_it if r["words"] == command] or of_it  # the variables differ, else all
        closest = "; it never ran" if not near else "; it ran as: " + " ".join(
            [*(f"{k}={starts.normalised(near[0]['env'].get(k, ''), near[0]['cwd'])}" for k in names),
             *near[0]["words"]])
        problems.append(f"{name}: never ran as its Run: line types it ({shown}){closest}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(f"usage: python -m ddpguide.launch.ran FOLDER (the folder {RAN_VARIABLE} named)"
              + (f": no folder {args[0]}" if len(args) == 1 else ""), file=sys.stderr)
        return 2
    problems = not_run_as_typed(args[0])
    for line in problems:
        print(line, file=sys.stderr)
    print(f"{len(records(args[0]))} program starts recorded; "
          f"{len(problems)} program(s) never ran as typed", file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
