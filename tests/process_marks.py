"""Which tests start processes: the ``multiprocess`` mark, put on by reading the tests' code,
and a check, while the tests run, that no unmarked test starts one.

``make test-fast`` runs ``-m "not multiprocess"``: every test that starts no process
(no process group, no subprocess). A test is marked when its code, the fixtures it
uses or the functions of ``tests`` it calls (followed through their own calls) name
one of ``STARTERS``. Package functions are not followed: a test that starts processes
only through one (a benchmark's ``run``, say) is caught while it runs and fails with
the line to add, ``@pytest.mark.multiprocess``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import multiprocessing.process
import subprocess
import textwrap
from pathlib import Path

import pytest

MARK = "multiprocess"
# Names whose use starts a process: launchers, the subprocess module, the fixture that
# shares one process group per test module.
STARTERS = frozenset({
    "spawn", "run_several", "spawned", "subprocess", "Popen", "multiprocessing",
    "torchrun", "TORCHRUN", "start_processes", "elastic_launch", "spawn_default_run",
})
TESTS = Path(__file__).resolve().parent
#: Programs a library starts to ask about the machine (not a process group or a test's worker).
PROBES = frozenset({"uname", "ldconfig", "ldconfig.real", "gcc", "cc", "objdump", "ld"})


@functools.cache
def _module_tree(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return None


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> module of every ``from tests.x import name`` in ``tree``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _module_file(dotted: str) -> Path | None:
    """The file of ``tests.a.b`` (a module), or None."""
    parts = dotted.split(".")[1:]
    path = TESTS.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


@functools.cache
def _starts_processes(path: str, name: str) -> bool:
    """Whether top-level ``name`` of the file ``path`` names a starter, itself or through
    the functions of the same file and of ``tests`` modules it uses."""
    seen: set[tuple[str, str]] = set()
    todo = [(path, name)]
    while todo:
        where, what = todo.pop()
        if (where, what) in seen:
            continue
        seen.add((where, what))
        tree = _module_tree(where)
        if tree is None:
            continue
        defs = {n.name: n for n in tree.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        if what not in defs:
            continue
        names = _names(defs[what])
        if names & STARTERS:
            return True
        imports = _imports(tree)
        for used in names:
            if used in defs:
                todo.append((where, used))
            elif used in imports:
                dotted = imports[used]
                module = _module_file(dotted)
                if module is not None:  # a helper module: anything in it it names
                    helper = _module_tree(str(module))
                    if helper is not None and _names(helper) & STARTERS:
                        return True
                else:
                    owner = _module_file(dotted.rpartition(".")[0])
                    if owner is not None:
                        todo.append((str(owner), dotted.rpartition(".")[2]))
    return False


def _function_starts_processes(fn) -> bool:
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return False
    if path is None or not Path(path).resolve().is_relative_to(TESTS):
        return False
    if getattr(fn, "__qualname__", "").count(".") == 0:
        return _starts_processes(str(Path(path).resolve()), fn.__name__)
    try:  # a method: read its own source
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, SyntaxError):
        return False
    return bool(_names(tree) & STARTERS)


def needs_processes(item: pytest.Item) -> bool:
    """Whether ``item`` uses a starter, in its code or in a fixture it uses."""
    if not isinstance(item, pytest.Function):
        return False
    if _function_starts_processes(item.function):
        return True
    if STARTERS & set(item.fixturenames):
        return True
    info = item._fixtureinfo
    for name in item.fixturenames:
        for definition in info.name2fixturedefs.get(name, ()):
            if _function_starts_processes(definition.func):
                return True
    return False


def mark_items(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(MARK) is None and needs_processes(item):
            item.add_marker(MARK)


class ProcessWatch:
    """Counts the processes started (``subprocess.Popen``, ``multiprocessing``) while a
    test runs; an unmarked test that starts one fails."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.item: pytest.Item | None = None
        self._popen = subprocess.Popen._execute_child  # type: ignore[attr-defined]
        self._start = multiprocessing.process.BaseProcess.start
        watch = self

        def execute_child(popen, args, *rest, **kw):
            argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
            # Probes that answer a question about this machine and exit, started by the
            # library rather than by the test: platform.processor() runs uname once, and
            # ctypes.util.find_library (torch's first import) runs ldconfig -p.
            if Path(argv[0]).name not in PROBES if argv else True:
                watch.saw(" ".join(argv))
            return watch._popen(popen, args, *rest, **kw)

        def start(process):
            watch.saw(f"multiprocessing: {process.name}")
            return watch._start(process)

        subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]

    def close(self) -> None:
        subprocess.Popen._execute_child = self._popen  # type: ignore[attr-defined]
        multiprocessing.process.BaseProcess.start = self._start  # type: ignore[method-assign]

    def begin(self, item: pytest.Item) -> None:
        self.started, self.item = [], item

    def saw(self, what: str) -> None:
        """Record a start; in an unmarked test, fail it there (an outcome, which no
        ``except Exception`` in the code under test swallows)."""
        self.started.append(what)
        if self.item is not None and self.item.get_closest_marker(MARK) is None:
            self._fail(self.item, what)

    def check(self, item: pytest.Item) -> None:
        """After the test: fail it if it started a process unmarked."""
        started, self.started, self.item = self.started, [], None
        if started and item.get_closest_marker(MARK) is None:
            self._fail(item, started[0])

    @staticmethod
    def _fail(item: pytest.Item, what: str) -> None:
        pytest.fail(f"{item.nodeid} starts a process ({what[:120]}) but is not marked: add "
                    f"@pytest.mark.{MARK} (make test-fast runs only tests that start none)",
                    pytrace=False)

