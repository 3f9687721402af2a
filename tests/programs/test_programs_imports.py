"""Every book program stands alone: it imports only the standard library, torch, torchvision,
numpy and scikit-learn (and the library its chapter teaches: torchft), and its docstring says
what it shows and how to run it."""

from __future__ import annotations

import ast
import sys

import pytest

from tests.programs.programs_support import PROGRAMS

ALLOWED = set(sys.stdlib_module_names) | {"torch", "torchvision", "numpy", "sklearn"}
#: the field's own libraries a chapter teaches, by program
EXTRA = {"ft_train.py": {"torchft"}, "plan_step.py": {"plan_cost"}}  # plan_step.py: its neighbour, copied with it
EXTRA["diloco_digits.py"] = {"torchft"}
EXTRA["plan_measure.py"] = {"plan_cost"}  # its neighbour too: the Hardware it fills
NAMES = sorted(path.name for path in PROGRAMS.glob("*.py"))
#: every program and module below book/programs, in every folder (gpt/, debug/)
ALL = sorted(str(path.relative_to(PROGRAMS)) for path in PROGRAMS.glob("**/*.py"))


def imported_modules(tree: ast.Module) -> set[str]:
    """Top-level names of every module imported anywhere in the file (relative imports as '.')."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


def test_the_programs_are_there():
    assert {"ddp_spawn.py", "ddp_torchrun.py", "elastic_train.py", "amp_ddp.py",
            "ring_allreduce.py", "dtensor_sbp.py", "linear_regression_ddp.py",
            "pipeline_pipelining.py"} <= set(NAMES)


def test_every_folder_of_programs_is_checked():
    assert {"gpt/train.py", "gpt/model.py", "debug/deadlock.py", "ddp_spawn.py"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_a_program_imports_nothing_but_the_allowed_libraries(name):
    path = PROGRAMS / name
    tree = ast.parse(path.read_text(), filename=name)
    neighbours = {p.stem for p in path.parent.glob("*.py")} if path.parent != PROGRAMS else set()
    outside = imported_modules(tree) - ALLOWED - neighbours - EXTRA.get(name, set())
    assert not outside, f"{name} imports {sorted(outside)}"


@pytest.mark.parametrize("name", NAMES)
def test_a_program_says_how_to_run_it(name):
    docstring = ast.get_docstring(ast.parse((PROGRAMS / name).read_text())) or ""
    assert "Run" in docstring and name in docstring
    assert "source" in docstring.lower()  # which article it comes from, and what it fixes
