"""CONTRIBUTING.md's walkthrough describes the chapter that was built: every file, module,
function, program name and registry row it names exists, as written."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from ddpguide import CHAPTERS
from ddpguide.bench import SUITES
from tests.test_layout import ALLOWED

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "book" / "programs"


def walkthrough() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    return text[text.index("## Walked through: chapter 11"):]


def spans() -> list[str]:
    return re.findall(r"`([^`]+)`", walkthrough().replace("\n   ", " "))


def top_level_names(program: Path) -> set[str]:
    names = set()
    for node in ast.parse(program.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_file_named_exists():
    paths = [s for s in spans() if re.fullmatch(r"[\w./-]+(\.(py|ipynb|json|yml|md)|/)", s)]
    assert len(paths) >= 8
    missing = [p for p in paths if not (ROOT / p).exists() and not (PROGRAMS / p).exists()]
    assert missing == []


def test_every_program_name_and_package_function_named_exists():
    checked = 0
    for span in spans():
        match = re.fullmatch(r"(\w+)\.(\w+)(?:\.(\w+))?", span)
        if not match:
            continue
        first, second, third = match.groups()
        if (PROGRAMS / f"{first}.py").exists() and third is None:  # ring_attention.chunks_of
            assert second in top_level_names(PROGRAMS / f"{first}.py"), span
            checked += 1
        elif (ROOT / "ddpguide" / first).is_dir():  # context.program.work_per_rank
            module = importlib.import_module(f"ddpguide.{first}.{second}")
            assert third is None or hasattr(module, third), span
            checked += 1
    assert checked >= 15


def test_the_registry_rows_quoted_are_the_real_ones():
    text = " ".join(spans())
    chapter = re.search(r'"11_context_parallel": (\(.*?\), \(.*?\)\))', text).group(1)
    assert ast.literal_eval(chapter) == CHAPTERS["11_context_parallel"]
    allowed = re.search(r'"context": (\{[^}]*\})', text).group(1)
    assert ast.literal_eval(allowed) == ALLOWED["context"] and "context" in ALLOWED["bench"]
    suite = re.search(r'"context": ("[^"]*")', text).group(1)
    assert ast.literal_eval(suite) == SUITES["context"]
    assert "- file: book/11_context_parallel" in (ROOT / "_toc.yml").read_text()
