"""CONTRIBUTING.md's walkthrough describes the chapter that was built: every file, module,
function, program name and registry row it names exists, as written; its program contract
is the code's (its example program runs, and the package reads its report)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide import CHAPTERS
from ddpguide.bench import SUITES
from ddpguide.launch import programs
from ddpguide.launch import report as report_module
from ddpguide.launch.report import ReportError
from tests import test_layout
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


@pytest.mark.multiprocess  # importing the figure modules, matplotlib may ask fc-list for fonts
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


def contract() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    return text[text.index("## What a program owes the package"):text.index("## Walked through")]


def contract_examples() -> tuple[str, str]:
    """The section's first two blocks: the program, and the package reading its report."""
    program, reader, _ = re.findall(r"```python\n(.*?)```", contract(), re.S)
    return program, reader


def test_the_contract_s_live_log_example_reads_whole_lines_only(tmp_path):
    log_reader = re.findall(r"```python\n(.*?)```", contract(), re.S)[2]
    log = tmp_path / "epochs.jsonl"
    log.write_text('{"epoch": 0, "world_size": 1}\n{"epoch": 1, "world_size": 2}\n{"epoch": 2, "wor')
    exec(log_reader, {"log": log})
    log.write_text('{"epoch": 0, "world_size": 1}\n{"epoch": 1, "world_size": 2')  # the second unfinished
    with pytest.raises(AssertionError):
        exec(log_reader, {"log": log})


def test_the_contract_s_example_program_reports_and_the_package_reads_it(tmp_path):
    program, reader = contract_examples()
    (tmp_path / "sum.py").write_text(program)
    done = subprocess.run([sys.executable, "sum.py", "--report", "report.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "check passed: the sum of 0..9 is 45\n", "")
    exec(reader, {"path": tmp_path / "report.json"})


def test_the_contract_s_example_refuses_bad_input_and_its_reader_fails_on_a_bad_report(tmp_path):
    program, reader = contract_examples()
    (tmp_path / "sum.py").write_text(program)
    done = subprocess.run([sys.executable, "sum.py", "--report", "no/report.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"sum.py: error: argument --report: no folder {tmp_path / 'no'}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sum.py"]
    (tmp_path / "report.json").write_text('{"checks": [{"name": "the sum of 0..9 is 45", "ok": false}], "sum": 44}')
    with pytest.raises(AssertionError):
        exec(reader, {"path": tmp_path / "report.json"})
    (tmp_path / "report.json").write_text('{"sum": 45}')
    with pytest.raises(ReportError, match=r"^sum.py: the report .* has no list of checks$"):
        exec(reader, {"path": tmp_path / "report.json"})


def test_the_contract_names_only_what_exists():
    text = contract()
    assert "ProgramRun.checks" not in text
    for name in re.findall(r"`programs\.(\w+)", text) + re.findall(r"`(\w+)`, ", text):
        if name in {"path_of", "load", "run", "copy_program", "show", "diff"}:
            assert hasattr(programs, name), name
    for name in ("read", "failed", "ReportError", "read_log"):
        assert f"launch.report.{name}" in text or f"`{name}`" in text
        assert hasattr(report_module, name), name
    assert "PROGRAMS_USED" in text and hasattr(test_layout, "PROGRAMS_USED")
