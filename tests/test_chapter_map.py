"""The one chapter map (``ddpguide.CHAPTERS``) against what the notebooks really import and run.

The map is written once, in ``ddpguide/__init__.py``. This test reads every
notebook's code cells and fails when a chapter imports a module, or runs a
``python -m ddpguide.<command>``, that its row does not name (or names one it
does not use); and it checks the two tables written for readers, the chapter
table of ``book/intro.md`` and the subpackage table of ``README.md``, against it.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ddpguide import CHAPTERS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))


def _is_module(name: str) -> bool:
    parts = name.split(".")
    return (ROOT.joinpath(*parts).with_suffix(".py").exists()
            or (ROOT.joinpath(*parts) / "__init__.py").exists())


def code_of(notebook: Path) -> list[str]:
    """The code cells, without IPython's ``%magic`` and ``!shell`` lines."""
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    return ["\n".join(line for line in "".join(c["source"]).splitlines()
                      if not line.lstrip().startswith(("%", "!"))) for c in cells]


def imported_modules(notebook: Path) -> set[str]:
    """The ddpguide modules the notebook's code imports (``from ddpguide.a import b``: ``a.b``
    when ``b`` is a module, else ``a``), without the ``ddpguide.`` prefix."""
    found: set[str] = set()
    for source in code_of(notebook):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ddpguide":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if _is_module(full) else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "ddpguide")
    return {name.removeprefix("ddpguide.") for name in found if name != "ddpguide"}


def commands_run(notebook: Path) -> set[str]:
    """The ``python -m ddpguide.<command>`` commands named anywhere in the notebook."""
    return set(re.findall(r"python -m ddpguide\.(\w+)", notebook.read_text()))


def test_every_notebook_has_its_row():
    assert sorted(CHAPTERS) == [nb.stem for nb in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_the_map_names_what_the_chapter_imports_and_runs(notebook):
    _, modules, commands = CHAPTERS[notebook.stem]
    assert sorted(imported_modules(notebook)) == list(modules)
    assert sorted(commands_run(notebook)) == list(commands)
    assert all(_is_module(f"ddpguide.{m}") for m in modules)


def test_the_intro_table_is_the_map():
    rows = {}
    for line in (ROOT / "book" / "intro.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows[cells[0]] = sorted(re.findall(r"`([\w.]+)`", cells[3]))
    chapters = {number: list(modules) for number, modules, _ in CHAPTERS.values()
                if number.isdigit()}
    assert rows == chapters


def test_the_readme_says_which_chapters_use_each_subpackage():
    uses: dict[str, set[str]] = {}
    for number, modules, commands in CHAPTERS.values():
        for name in {m.split(".")[0] for m in modules} | set(commands):
            uses.setdefault(name, set()).add(number)
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        match = re.match(r"\| `ddpguide\.(\w+)` \|.*\| ([\w ,]+) \|$", line)
        if match and match.group(1) != "core":  # core: every chapter stands on it
            rows[match.group(1)] = set(re.split(r",\s*", match.group(2).strip()))
    assert rows == {name: uses.get(name, set()) for name in rows}
    assert set(rows) | {"core"} == {p.name for p in (ROOT / "ddpguide").iterdir()
                                    if (p / "__init__.py").exists()}
