"""The chapter's programs run on their own (a copy in an empty folder) and their checks pass."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from ddpguide.launch.programs import ProgramRun, run, torchrun

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
ALLOWED = {"torch", "torchvision", "numpy", "sklearn"}


_RUNS: dict[str, ProgramRun] = {}


def ran(name: str) -> ProgramRun:
    """The reader's command on a copy of the program alone in a fresh folder (once per module)."""
    if name not in _RUNS:
        _RUNS[name] = run(name, launcher=torchrun(2), timeout=240, expect=None, echo=False)
    return _RUNS[name]


@pytest.mark.parametrize("name, checks", [
    ("zero1.py", 1), ("fsdp2.py", 2), ("zero3_by_hand.py", 1), ("fsdp2_recipes.py", 7),
])
@pytest.mark.timeout(600)
def test_program_runs_standalone_and_its_checks_pass(name, checks):
    result = ran(name)
    assert result.returncode == 0, result.output[-3000:]
    passed = [line for line in result.output.splitlines() if line.startswith("check passed:")]
    assert len(passed) == checks, result.output[-3000:]
    assert "check FAILED" not in result.output


@pytest.mark.parametrize("name", ["zero1.py", "fsdp2.py", "zero3_by_hand.py", "fsdp2_recipes.py"])
def test_program_imports_only_torch_and_the_standard_library(name):
    tree = ast.parse((PROGRAMS / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots - ALLOWED <= set(sys.stdlib_module_names), roots


@pytest.mark.timeout(600)
def test_fsdp2_program_prints_the_shards_and_the_collectives():
    out = ran("fsdp2.py").output
    assert "[rank 0] 2.weight global (5, 10) -> local (3, 10), placements (Shard(dim=0),)" in out
    assert "[rank 1] 2.weight global (5, 10) -> local (2, 10), placements (Shard(dim=0),)" in out
    assert "forward         all_gather      S(0) -> B   x3" in out
    assert "backward        reduce_scatter  P -> S(0)   x3" in out
    assert "reshard_after_forward=False, backward: {'_reduce_scatter_base_': 3}" in out
    assert "mixed precision: stored torch.float32, computed torch.bfloat16" in out


@pytest.mark.timeout(600)
def test_zero3_program_pads_and_frees():
    out = ran("zero3_by_hand.py").output
    assert "[rank 0] 4.bias     3 elements -> shard of 2 (the flat tensor ends with 1 zero of padding)" in out
    assert "collectives of one step: {'all_gather': 12, 'reduce_scatter': 6}" in out
    assert "and 0 bytes of full parameters" in out


@pytest.mark.timeout(600)
def test_fsdp2_recipes_counts_what_the_chapter_says():
    out = ran("fsdp2_recipes.py").output
    assert "per micro-batch [0, 4, 0, 4] (4 units)" in out
    assert "all-gathers per step 7 -> 7" in out
    saved = re.search(r"activation checkpointing: (\d+) -> (\d+) bytes", out)
    assert saved and int(saved.group(2)) < int(saved.group(1)) / 4, out[-2000:]
