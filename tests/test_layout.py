"""The package's layout rules (written in ``ddpguide/__init__.py``), read from the imports.

Every ``import`` counts, also those inside functions: a lazy import is still a
dependency, and a circle through one still loads a module twice. The arrows from the
package to the book's programs count too: which subpackage loads, runs or copies which
program (``programs.load("...")``, read from the calls), and no program imports the
package.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ddpguide"
PROGRAMS = PACKAGE.parent / "book" / "programs"
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
    "cluster": {"core", "launch"},
    "plan": {"core", "launch", "gpt", "cluster"},
    "failures": {"core", "launch", "cluster"},
    "slurm": {"core", "launch", "cluster", "failures"},
    "bench": {"core", "launch", "collectives", "ddp", "train", "pipeline", "sbp", "elastic",
              "sharding", "doctor", "context", "experts", "gpt", "cluster", "plan", "failures",
              "slurm"},
}


#: Which programs of book/programs each subpackage may load, run or copy (``launch.programs``).
PROGRAMS_USED = {
    "train": {"amp_ddp.py", "ddp_torchrun.py"},
    "sbp": {"dtensor_regression.py"},
    "elastic": {"elastic_train.py"},
    "sharding": {"zero3_by_hand.py", "dcp_reshard.py", "tensor_parallel.py", "fsdp_tp_2d.py"},
    "context": {"ring_attention.py"},
    "experts": {"moe_expert_parallel.py"},
    "gpt": {"gpt/train.py", "gpt/model.py", "gpt/cost_model.py", "gpt/cost_meter.py", "gpt/parallelize.py"},
    "plan": {"plan_cost.py", "plan_step.py", "plan_measure.py", "gpt/train.py", "gpt/model.py", "gpt/parallelize.py"},
    "failures": {"ft_train.py", "elastic_train.py"},
    "slurm": {"slurm_requeue.py", "ft_train.py"},
    "cluster": {"cluster/collectives.py", "cluster/sharding.py", "cluster/ddp_overlap.py",
                "cluster/dead_link.py"},
    "bench": {"ring_attention.py", "moe_expert_parallel.py", "pipeline_schedules.py", "diloco_digits.py"},
}
#: the functions of ``ddpguide.launch.programs`` that take a program's name first
PROGRAM_FUNCTIONS = {"load", "run", "copy_program", "path_of", "show", "show_diff", "diff"}


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


def _string_constants(tree: ast.Module) -> dict[str, str]:
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def programs_used(path: Path, root: Path) -> list[tuple[int, str | None]]:
    """``(line, program)`` for each call of a ``launch.programs`` function in ``path``; the
    program read from a string, a module constant (here or imported), or a parameter's
    default; None where it cannot be read."""
    tree = ast.parse(path.read_text(), str(path))
    here = _string_constants(tree)
    functions, modules, names = {}, set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(root.name):
            for alias in node.names:
                if node.module == f"{root.name}.launch.programs" and alias.name in PROGRAM_FUNCTIONS:
                    functions[alias.asname or alias.name] = alias.name
                elif node.module == f"{root.name}.launch" and alias.name == "programs":
                    modules.add(alias.asname or alias.name)
                names[alias.asname or alias.name] = (node.module, alias.name)
    defaults: dict[str, list[ast.expr]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = fn.args.args[len(fn.args.args) - len(fn.args.defaults):]
            for arg, default in [*zip(positional, fn.args.defaults), *zip(fn.args.kwonlyargs, fn.args.kw_defaults)]:
                if default is not None:
                    defaults.setdefault(arg.arg, []).append(default)

    def constants_of(module: str) -> dict[str, str]:
        file = root.parent / Path(*module.split("."))
        file = file.with_suffix(".py") if file.with_suffix(".py").exists() else file / "__init__.py"
        return _string_constants(ast.parse(file.read_text())) if file.exists() else {}

    def read(expr: ast.expr, depth: int = 0) -> list[str | None]:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return [expr.value]
        if isinstance(expr, ast.Name) and expr.id in here:
            return [here[expr.id]]
        if isinstance(expr, ast.Name) and expr.id in names:
            found = constants_of(names[expr.id][0]).get(names[expr.id][1])
            if found:
                return [found]
        if isinstance(expr, ast.Name) and expr.id in defaults and depth < 2:
            return [name for default in defaults[expr.id] for name in read(default, depth + 1)]
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in names:
            found = constants_of(".".join(names[expr.value.id])).get(expr.attr)
            if found:
                return [found]
        return [None]

    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Name) and f.id in functions) or (
                    isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id in modules and f.attr in PROGRAM_FUNCTIONS):
                used += [(node.lineno, name) for name in read(node.args[0])]
    return used


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of a module and of its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def paths_into_programs(path: Path) -> list[int]:
    """The lines of ``path`` that build a path into ``book/programs`` by themselves: a string
    (not a docstring, nor a sentence) that is ``programs`` or holds ``book/programs``, or the ``PROGRAMS``
    folder of ``launch.programs`` divided by a name (``PROGRAMS / "x.py"``)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstrings(tree)
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings
                and (node.value.strip("/") == "programs"
                     or ("book/programs" in node.value and not any(c.isspace() for c in node.value)))):
            lines.add(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left = node.left
            name = left.attr if isinstance(left, ast.Attribute) else getattr(left, "id", None)
            if name == "PROGRAMS":
                lines.add(node.lineno)
    return sorted(lines)


def program_violations(root: Path, programs: Path) -> list[str]:
    """Every unlisted arrow from the package to a program, every path into the programs
    built outside ``launch.programs`` (an arrow this rule could not see), and every program
    that imports the package (a program imports torch and the standard library only)."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if module == f"{root.name}.launch.programs":
            continue
        problems += [f"{module}:{line} builds a path into the programs: use launch.programs"
                     for line in paths_into_programs(path)]
        for line, name in programs_used(path, root):
            sub = subpackage(module)
            if name is None:
                problems.append(f"{module}:{line} uses a program whose name cannot be read")
            elif name not in PROGRAMS_USED.get(sub or "", set()):
                problems.append(f"{module}:{line} uses program {name}, not listed for {sub} "
                                "in PROGRAMS_USED")
    for path in sorted(programs.glob("**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(name.split(".")[0] == root.name for name in names):
                problems.append(f"{path.relative_to(programs)}:{node.lineno} imports {root.name}")
    return problems


def test_the_package_keeps_its_layout_rules():
    assert violations(PACKAGE) == []


def test_the_package_uses_only_the_programs_listed_and_no_program_imports_it():
    assert program_violations(PACKAGE, PROGRAMS) == []


def test_an_unlisted_program_and_a_program_importing_the_package_are_caught(tmp_path, healthy):
    healthy["launch/__init__.py"] = ""
    healthy["launch/programs.py"] = "def load(name): pass\n"
    healthy["train/loop.py"] = ("from ddpguide.launch import programs\nPROGRAM = 'amp_ddp.py'\n"
                                "def f(program=PROGRAM):\n    programs.load(program)\n"
                                "    programs.load('zero1.py')\n")
    healthy["train/other.py"] = ("from ddpguide.launch.programs import run as go\n"
                                 "from ddpguide.train.loop import PROGRAM\n"
                                 "def g(name):\n    go(PROGRAM)\n    go(name)\n")
    programs = tmp_path / "programs"
    (programs / "gpt").mkdir(parents=True)
    (programs / "ok.py").write_text("import torch\n")
    (programs / "gpt" / "train.py").write_text("import model\nfrom ddpguide.core import runtime\n")
    assert program_violations(write_tree(tmp_path, healthy), programs) == [
        "ddpguide.train.loop:5 uses program zero1.py, not listed for train in PROGRAMS_USED",
        "ddpguide.train.other:5 uses a program whose name cannot be read",
        "gpt/train.py:2 imports ddpguide",
    ]


def test_a_path_into_the_programs_built_outside_launch_programs_is_caught(tmp_path, healthy):
    healthy["launch/__init__.py"] = ""
    healthy["launch/programs.py"] = ("from pathlib import Path\n"
                                     "PROGRAMS = Path(__file__).parents[2] / 'book' / 'programs'\n")
    healthy["train/loop.py"] = ('"""Runs book/programs/amp_ddp.py (a docstring may say so)."""\n'
                                "from pathlib import Path\n"
                                "HERE = Path(__file__).resolve().parents[2] / 'book' / 'programs'\n"
                                "def f():\n    return HERE / 'amp_ddp.py'\n")
    healthy["train/other.py"] = ("from ddpguide.launch import programs\n"
                                 "from ddpguide.launch.programs import PROGRAMS\n"
                                 "A = programs.PROGRAMS / 'amp_ddp.py'\n"
                                 "B = PROGRAMS / 'cluster'\n"
                                 "C = 'book/programs/zero1.py'\n"
                                 "D = 'from book/programs/zero1.py (a source named)'\n")
    programs = tmp_path / "programs"
    programs.mkdir()
    assert program_violations(write_tree(tmp_path, healthy), programs) == [
        "ddpguide.train.loop:3 builds a path into the programs: use launch.programs",
        "ddpguide.train.other:3 builds a path into the programs: use launch.programs",
        "ddpguide.train.other:4 builds a path into the programs: use launch.programs",
        "ddpguide.train.other:5 builds a path into the programs: use launch.programs",
    ]


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
