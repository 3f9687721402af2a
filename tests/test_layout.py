"""The package's layout rules (written in ``ddpguide/__init__.py``), read from the imports.

Every ``import`` counts, also those inside functions: a lazy import is still a
dependency, and a circle through one still loads a module twice.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ddpguide"
MAX_LINES = 300

#: Which subpackages each subpackage may import (besides itself).
ALLOWED = {
    "core": set(),
    "launch": {"core"},
    "collectives": {"core", "launch"},
    "train": {"core", "launch"},
    "ddp": {"core", "launch", "collectives", "train"},
    "pipeline": {"core", "launch", "collectives"},
    "sbp": {"core", "launch"},
    "elastic": {"core", "launch", "train", "sharding"},
    "sharding": {"core", "launch", "collectives", "sbp", "train"},
    "doctor": {"core", "launch", "collectives"},
    "context": {"core", "launch"},
    "experts": {"core", "launch"},
    "gpt": {"core", "launch"},
    "failures": {"core", "launch"},
    "bench": {"core", "launch", "collectives", "ddp", "train", "pipeline", "sbp", "elastic",
              "sharding", "doctor", "context", "experts", "gpt", "failures"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """The ddpguide modules that ``path`` imports (a package import counts as its __init__)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != root.name:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (root.parent / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    root.parent / Path(*sub.split(".")) / "__init__.py").exists()
                found.add(sub if is_module else target)
    found.discard(name)
    return found


def graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): imports_of(p, root) for p in sorted(root.rglob("*.py"))}


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def violations(root: Path) -> list[str]:
    """Every broken rule, one line each."""
    edges = graph(root)
    problems = []
    for module, targets in edges.items():
        here = subpackage(module)
        for target in sorted(targets):
            there = subpackage(target)
            if there is None or there == here:
                continue
            if here is None:
                problems.append(f"{module} imports {target}: the top-level package imports nothing")
            elif there == "bench":
                problems.append(f"{module} imports {target}: nothing imports bench")
            elif there not in ALLOWED.get(here, set()):
                problems.append(f"{module} imports {target}: {here} may import only "
                                f"{', '.join(sorted(ALLOWED.get(here, set()))) or 'nothing'}")
        for target in targets:
            if target.endswith(".viz") and subpackage(target) == here and not module.endswith(".viz"):
                problems.append(f"{module} imports {target}: figures sit on top of what they draw")
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{module_name(path, root)} has {lines} lines (at most {MAX_LINES})")
    return problems


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in edges:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group) + [sorted(group)[0]])

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_package_keeps_its_layout_rules():
    assert violations(PACKAGE) == []


def test_every_subpackage_has_its_rule():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(ALLOWED), f"no rule for {sorted(packages - set(ALLOWED))}"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    package = root / "ddpguide"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


@pytest.fixture
def healthy(tmp_path):
    return {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/runtime.py": "import os\n",
        "train/__init__.py": "",
        "train/loop.py": "from ddpguide.core.runtime import os\n",
        "train/viz.py": "from ddpguide.train import loop\n",
        "bench/__init__.py": "",
        "bench/ddp.py": "from ddpguide.train.loop import fit\n",
    }


def test_a_healthy_tree_passes(tmp_path, healthy):
    assert violations(write_tree(tmp_path, healthy)) == []


def test_an_upward_import_from_core_is_caught(tmp_path, healthy):
    healthy["core/runtime.py"] = "def f():\n    from ddpguide.train import loop\n"
    assert violations(write_tree(tmp_path, healthy)) == [
        "ddpguide.core.runtime imports ddpguide.train.loop: core may import only nothing",
        "import circle: ddpguide.core.runtime -> ddpguide.train.loop -> ddpguide.core.runtime",
    ]


def test_importing_bench_is_caught(tmp_path, healthy):
    healthy["train/loop.py"] = "from ..bench import ddp\n"
    assert violations(write_tree(tmp_path, healthy)) == [
        "ddpguide.train.loop imports ddpguide.bench.ddp: nothing imports bench",
        "import circle: ddpguide.bench.ddp -> ddpguide.train.loop -> ddpguide.bench.ddp",
    ]


def test_a_figure_imported_below_it_and_a_long_module_are_caught(tmp_path, healthy):
    healthy["train/loop.py"] = "from ddpguide.train.viz import plot\n" + "x = 1\n" * 300
    assert violations(write_tree(tmp_path, healthy)) == [
        "ddpguide.train.loop imports ddpguide.train.viz: figures sit on top of what they draw",
        "import circle: ddpguide.train.loop -> ddpguide.train.viz -> ddpguide.train.loop",
        "ddpguide.train.loop has 301 lines (at most 300)",
    ]


@functools.cache
def _imports_from(text: str) -> tuple[ast.ImportFrom, ...]:
    """The ``from ... import`` statements of a test's source (parsed once per source)."""
    return tuple(node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom))


def mentions(text: str, module: str) -> bool:
    """Whether a test's source imports or names ``module`` (``a.b.c`` or ``from a.b import c``)."""
    package, _, leaf = module.rpartition(".")
    if module in text:
        return True
    for node in _imports_from(text):
        if isinstance(node, ast.ImportFrom) and node.module == package:
            if any(alias.name == leaf for alias in node.names):
                return True
    return False


def test_every_module_has_a_test_of_its_name_or_is_named_in_one():
    tests = {p: p.read_text() for p in PACKAGE.parent.joinpath("tests").rglob("test_*.py")}
    untested = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        module = module_name(path, PACKAGE)
        own = [p for p in tests if p.name == f"test_{path.stem}.py"
               and p.parent.name == path.parent.name]
        if not own and not any(mentions(text, module) for text in tests.values()):
            untested.append(module)
    assert untested == []
