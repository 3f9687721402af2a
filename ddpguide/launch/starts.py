"""A record of every command the runner execs, for :mod:`ddpguide.launch.ran` to check.

While :data:`RAN_VARIABLE` names a folder (``make test`` sets it for the package tests and the
chapters alike), :meth:`ddpguide.launch.ranks.Ranks.start` calls :func:`record` for each
:class:`~ddpguide.launch.ranks.Command` whose words name a Python file: one JSON line in
``<folder>/<pid>.jsonl`` (one file a process: pytest-xdist workers and notebook kernels never
share one) with the command's words (not its prefix, such as ``ip netns exec``), its folder,
the SHA-256 of each ``.py`` file it names (which program it is, the check decides: an edited
copy is not the program), the variables the runner set for it beyond its own environment, and
who ran it (the test, under pytest). Without the variable nothing is read or written.

:func:`run_line` reads a program's ``Run:`` line, :func:`words` normalises a command and
:func:`is_run_line` compares the two (the rules: :mod:`ddpguide.launch.ran`), here, below
:mod:`ddpguide.launch.programs`, whose ``typed-once`` launch runs that line typed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import sys
import tokenize
from pathlib import Path
from typing import Mapping, Sequence

#: the folder the records go to (unset: nothing is recorded)
RAN_VARIABLE = "DDPGUIDE_RAN"
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HOST_PORT = re.compile(r"^([\w.\-\[\]]+):\d+$")


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


def _inside(path: str, cwd: str) -> bool:
    relative = os.path.relpath(path, cwd) if os.path.isabs(path) and cwd else path
    return not (os.path.isabs(relative) or relative == ".." or relative.startswith("../"))


def normalised(word: str, cwd: str) -> str:
    """One word (or a variable's value) as :mod:`ddpguide.launch.ran` normalises it, in ``cwd``."""
    if word.startswith("$PWD/"):
        return word.removeprefix("$PWD/")
    if os.path.isabs(word):
        return os.path.relpath(word, cwd) if cwd and _inside(word, cwd) else Path(word).name
    return _HOST_PORT.sub(r"\1:PORT", word)


def words(argv: Sequence[str], cwd: str | os.PathLike | None = None,
          program: str | None = None) -> list[str]:
    """``argv`` as the words a reader types, normalised as :mod:`ddpguide.launch.ran` says;
    ``program``: the word that is the program's path, replaced by its file name."""
    cwd = str(cwd or "")
    split: list[str] = []
    for word in argv:
        split += word.split("=", 1) if word.startswith("--") and "=" in word else [word]
    if split and (split[0] == sys.executable or Path(split[0]).name.startswith("python")):
        split[0] = "python"
        if split[1:3] == ["-m", "torch.distributed.run"]:
            split = ["torchrun", *split[3:]]
    elif split and Path(split[0]).name == "torchrun":  # the script beside the interpreter
        split[0] = "torchrun"
    if split[:1] == ["torchrun"]:
        end = split.index(program) if program in split else len(split)
        logs = [i for i in range(1, end - 1) if split[i] == "--log-dir"]
        # the runner's comes first (torchrun.Agent.argv); alone, it is the one outside the folder
        drop = set(logs[:-1]) | {i for i in logs if len(logs) == 1 and not _inside(split[i + 1], cwd)}
        split = [w for i, w in enumerate(split) if i not in drop and i - 1 not in drop]
    return [Path(w).name if w == program else normalised(w, cwd) for w in split]


def _raw_docstring(path: Path) -> str:
    """The program's docstring as written (backslashes kept: a continued line ends in one)."""
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING:
            return token.string
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING):
            return ""
    return ""


def run_line(program: Path) -> tuple[list[str], list[str]] | None:
    """The first command of the ``Run:`` line of the program at ``program``: the variables it
    sets (``NAME=value``) and its normalised words; None without a ``Run:`` line."""
    lines = _raw_docstring(program).splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Run:")), None)
    if start is None:
        return None
    text = lines[start].lstrip().removeprefix("Run:").strip()
    for line in lines[start + 1:]:
        if not text.endswith("\\"):
            break
        text = text[:-1].rstrip() + " " + line.strip()
    command = shlex.split(re.split(r"\s{2,}", text.strip())[0])
    assignments = [w for w in command if _ASSIGNMENT.match(w)]
    rest = command[len(assignments):] if command[:len(assignments)] == assignments else command
    return [a.partition("=")[0] + "=" + normalised(a.partition("=")[2], "") for a in assignments], \
        words(rest, program=program.name)


def is_run_line(program: Path, command: Sequence[str], env: Mapping[str, str], cwd: str) -> bool:
    """Whether ``command`` (the words typed in ``cwd``, with the variables ``env`` set for it)
    is the first command of the program's ``Run:`` line, normalised as :mod:`ddpguide.launch.ran`
    says."""
    typed = run_line(program)
    if typed is None:
        return False
    wanted = dict(a.split("=", 1) for a in typed[0])
    word = next((w for w in command if Path(w).name == program.name), None)
    got = words(command, cwd, word)
    return typed[1] in (got, without_report(got, program.name)) and all(
        normalised(env.get(k, ""), cwd) == v for k, v in wanted.items())


def without_report(command: Sequence[str], program: str) -> list[str]:
    """``command`` (normalised words) without the one ``--report FILE`` among the options
    after ``program``, the package's channel (:mod:`ddpguide.launch.report`); unchanged
    without exactly one."""
    at = command.index(program) + 1 if program in command else len(command)
    reports = [i for i in range(at, len(command) - 1) if command[i] == "--report"]
    if len(reports) != 1 or command[at:].count("--report") != 1:
        return list(command)
    return [w for i, w in enumerate(command) if i not in (reports[0], reports[0] + 1)]
