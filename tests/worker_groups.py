"""Which pytest-xdist worker runs which test file (``make test`` runs ``-n 2 --dist loadgroup``).

A file's tests run in one worker, so that its module fixtures start once; the files that
use one of this suite's session fixtures run in one worker together, so that it starts
once. pytest-xdist 3.8 groups by appending ``@group`` to each test's node id, which pytest
9.2 no longer lets a plugin change (``Node.nodeid`` is computed from ``Node._id``): the
groups are therefore given to the scheduler itself (:func:`scheduler`). The scheduler runs
in the controlling process, which collects nothing, so the groups are read from the test
files' source (:func:`static_groups`); each worker checks them against the fixtures pytest
actually resolved (:func:`collected_groups`) and stops the run if the two differ.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _fixture_scope(node: ast.AST) -> str | None:
    """The scope of a ``@pytest.fixture`` function (``"function"`` by default), or None."""
    if not isinstance(node, ast.FunctionDef):
        return None
    for deco in node.decorator_list:
        call = deco if isinstance(deco, ast.Call) else None
        if ast.unparse(call.func if call else deco) in ("pytest.fixture", "fixture"):
            for k in call.keywords if call else ():
                if k.arg == "scope" and isinstance(k.value, ast.Constant):
                    return str(k.value.value)
            return "function"
    return None


def _arguments(node: ast.FunctionDef) -> set[str]:
    return {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}


def static_groups(tests: Path) -> dict[str, str]:
    """Test file (relative to the root above ``tests``) -> its group: ``session fixture NAME``
    for a file whose functions ask, directly or through the fixtures of the conftest.py
    files above it, for a session fixture of one of those (the first name, sorted, if
    several), the file's own path otherwise."""
    root = tests.parent
    conftests: dict[Path, dict[str, tuple[str, set[str]]]] = {}  # folder -> fixture -> (scope, asks)
    for conftest in tests.rglob("conftest.py"):
        body = ast.parse(conftest.read_text()).body
        conftests[conftest.parent] = {n.name: (scope, _arguments(n)) for n in body
                                      if isinstance(n, ast.FunctionDef) and (scope := _fixture_scope(n))}
    groups = {}
    for path in sorted(tests.rglob("test_*.py")):
        visible: dict[str, tuple[str, set[str]]] = {}
        for folder in sorted((f for f in conftests if f == path.parent or f in path.parents),
                             key=lambda f: len(f.parts)):
            visible.update(conftests[folder])  # a nearer conftest.py overrides a farther one
        asked = set().union(*(_arguments(n) for n in ast.walk(ast.parse(path.read_text()))
                              if isinstance(n, ast.FunctionDef)))
        while True:  # and what the fixtures asked for ask for
            more = set().union(*(visible[name][1] for name in asked if name in visible)) - asked
            if not more:
                break
            asked |= more
        used = {name for name in asked if name in visible and visible[name][0] == "session"}
        name = path.relative_to(root).as_posix()
        groups[name] = f"session fixture {min(used)}" if used else name
    return groups


def collected_groups(items) -> dict[str, str]:
    """The same, from the fixtures pytest resolved for the collected ``items`` (a session
    fixture of a conftest.py under ``tests``, asked for directly or through another fixture)."""
    shared: dict[str, set[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = shared.setdefault(item.nodeid.split("::")[0], set())
        names.update(name for name, defs in (info.name2fixturedefs.items() if info else ())
                     if defs and defs[-1].scope == "session" and defs[-1].baseid.startswith("tests"))
    return {path: f"session fixture {min(names)}" if names else path for path, names in shared.items()}


def scheduler(config, log, groups: dict[str, str]):
    """pytest-xdist's ``loadgroup`` scheduler with each test's group taken from ``groups``
    (by its file): a group's tests go to one worker, in their order."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return groups.get(path, path)

    return FileGroups(config, log)
