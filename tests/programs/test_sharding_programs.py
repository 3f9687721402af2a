"""The chapter's programs run on their own (a copy in an empty folder) and their checks pass; what
they report with --report is what they printed."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from ddpguide.launch.programs import ProgramRun, load, run, torchrun
from tests.programs.report_support import assert_report_agrees

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
ALLOWED = {"torch", "torchvision", "numpy", "sklearn"}


_RUNS: dict[str, ProgramRun] = {}


def ran(name: str) -> ProgramRun:
    """The reader's command on a copy of the program alone in a fresh folder (once per module)."""
    if name not in _RUNS:
        _RUNS[name] = run(name, launcher=torchrun(2), timeout=240, expect=None, echo=False, report=True)
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
    report = assert_report_agrees(result)  # one reported check per printed line, same verdict
    assert report["program"] == name and report["world"] == 2 and len(report["checks"]) == checks


@pytest.mark.parametrize("name", ["zero1.py", "fsdp2.py", "zero3_by_hand.py", "fsdp2_recipes.py"])
def test_a_report_into_a_missing_folder_is_refused_in_one_line(name, tmp_path, monkeypatch, capsys):
    program = load(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stopped:
        program.parse_args(["--report", "missing/r.json"])
    captured = capsys.readouterr()
    assert (stopped.value.code, captured.out) == (2, "")
    assert captured.err == f"{name}: error: --report missing/r.json: no folder {tmp_path / 'missing'}\n"
    assert list(tmp_path.iterdir()) == []


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
    result = ran("fsdp2.py")
    out = result.output
    assert "[rank 0] 2.weight global (5, 10) -> local (3, 10), placements (Shard(dim=0),)" in out
    assert "[rank 1] 2.weight global (5, 10) -> local (2, 10), placements (Shard(dim=0),)" in out
    assert "forward         all_gather      S(0) -> B   x3" in out
    assert "backward        reduce_scatter  P -> S(0)   x3" in out
    assert "reshard_after_forward=False, backward: {'_reduce_scatter_base_': 3}" in out
    assert "mixed precision: stored torch.float32, computed torch.bfloat16" in out
    report = result.report
    shards = {(r["rank"], p["name"]): (p["local"], p["placements"]) for r in report["ranks"] for p in r["parameters"]}
    assert shards[0, "2.weight"] == ([3, 10], "(Shard(dim=0),)")
    assert shards[1, "2.weight"] == ([2, 10], "(Shard(dim=0),)")
    assert report["collectives"]["forward"] == {"_allgather_base_": 3}
    assert report["collectives"]["backward, reshard_after_forward=False"] == {"_reduce_scatter_base_": 3}
    assert report["mixed_precision"] == {"stored": "torch.float32", "computed": "torch.bfloat16",
                                         "output": "torch.bfloat16", "gradient": "torch.float32"}


@pytest.mark.timeout(600)
def test_zero1_program_reports_each_rank_s_share():
    result = ran("zero1.py")
    ranks = result.report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    owned = [name for r in ranks for name in r["owns"]]
    assert sorted(owned) == sorted(f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias"))
    check = result.report["checks"][0]
    assert check["adam_state_bytes"]["ranks together"] == check["adam_state_bytes"]["one process"]
    assert sum(r["adam_state_bytes"] for r in ranks) == check["adam_state_bytes"]["one process"]
    for r in ranks:
        line = f"[rank {r['rank']}] owns {', '.join(r['owns'])}: Adam state {r['adam_state_bytes']} bytes"
        assert line in result.output


@pytest.mark.timeout(600)
def test_zero3_program_pads_and_frees():
    result = ran("zero3_by_hand.py")
    out = result.output
    assert "[rank 0] 4.bias     3 elements -> shard of 2 (the flat tensor ends with 1 zero of padding)" in out
    assert "collectives of one step: {'all_gather': 12, 'reduce_scatter': 6}" in out
    assert "and 0 bytes of full parameters" in out
    report = result.report
    flat = {(r["rank"], p["name"]): (p["elements"], p["shard"], p["padding"])
            for r in report["ranks"] for p in r["parameters"]}
    assert flat[0, "4.bias"] == flat[1, "4.bias"] == (3, 2, 1)
    assert report["collectives_of_one_step"] == {"all_gather": 12, "reduce_scatter": 6}
    assert report["between_steps"]["full_parameter_bytes"] == 0


@pytest.mark.timeout(600)
def test_fsdp2_recipes_counts_what_the_chapter_says():
    result = ran("fsdp2_recipes.py")
    out = result.output
    assert "per micro-batch [0, 4, 0, 4] (4 units)" in out
    assert "all-gathers per step 7 -> 7" in out
    saved = re.search(r"activation checkpointing: (\d+) -> (\d+) bytes", out)
    assert saved and int(saved.group(2)) < int(saved.group(1)) / 4, out[-2000:]
    counted = {key: value for c in result.report["checks"] for key, value in c.items()
               if key not in ("name", "ok")}
    assert counted["reduce_scatters_per_micro_batch"] == [0, 4, 0, 4]
    assert counted["all_gathers_per_step"] == {"plain": 7, "checkpointed": 7}
    assert counted["saved_bytes"] == {"plain": int(saved.group(1)), "checkpointed": int(saved.group(2))}
