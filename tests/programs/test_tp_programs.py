"""The tensor-parallel chapter's programs, run standalone from a copy with torchrun: checks pass."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

from ddpguide.launch.programs import run, torchrun
from tests.programs.programs_support import PYTHON
from tests.programs.programs_support import run as run_in_shell
from tests.programs.report_support import assert_report_agrees

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
NAMES = ("tensor_parallel.py", "fsdp_tp_2d.py", "dcp_reshard.py")


@pytest.fixture
def copies(tmp_path: Path) -> Path:
    """The programs alone in a fresh folder: nothing from the book or the package beside them."""
    for name in NAMES:
        shutil.copy(PROGRAMS / name, tmp_path / name)
    return tmp_path


def run_program(name: str, nproc: int, args=(), timeout: float = 240.0, workdir=None):
    """The reader's command on a copy of the program alone in a fresh folder."""
    return run(name, *args, launcher=torchrun(nproc), timeout=timeout, expect=None, echo=False,
               workdir=workdir, report=True)


@pytest.mark.parametrize("name", NAMES)
def test_programs_import_only_torch_and_the_standard_library(name):
    tree = ast.parse((PROGRAMS / name).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported - set(sys.stdlib_module_names) == {"torch"}


@pytest.mark.timeout(300)
def test_tensor_parallel_program():
    launch = run_program("tensor_parallel.py", 2, timeout=240)
    assert launch.returncode == 0, launch.text()
    checks = assert_report_agrees(launch)["checks"]
    assert [c["case"] for c in checks] == ["MLP", "Attention", "Sequence parallel"]
    assert all(c["ok"] and c["worst"] <= 1e-12 for c in checks), launch.text()
    assert checks[0]["collectives"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    lines = launch.lines()
    assert "all checks passed" in lines
    assert any(line.split()[:2] == ["up.weight", "(Shard(dim=0),)"] for line in lines)
    assert any(line.split()[:2] == ["down.weight", "(Shard(dim=1),)"] for line in lines)
    assert "  down computes (Partial(sum),) and hands on (Replicate(),)" in lines
    assert "  collectives: forward {'all_reduce': 1}, backward {'all_reduce': 1}" in lines


@pytest.mark.timeout(400)
def test_fsdp_tp_2d_program():
    launch = run_program("fsdp_tp_2d.py", 4, timeout=360)
    assert launch.returncode == 0, launch.text()
    checks = assert_report_agrees(launch)["checks"]
    assert [(c["layout"], c["ok"]) for c in checks] == [("FSDP x TP", True), ("HSDP", True)], launch.text()
    assert all(c["losses"] == pytest.approx(launch.report["one_process_losses"], abs=1e-12) for c in checks)
    assert "all checks passed" in launch.lines()


@pytest.mark.timeout(500)
def test_dcp_program_saves_with_2_and_loads_with_3(tmp_path):
    checkpoint = tmp_path / "dcp_checkpoint"  # its default --dir: the two lines of its Run:, as typed
    saved = run_program("dcp_reshard.py", 2, [], timeout=240, workdir=tmp_path)
    assert saved.returncode == 0, saved.text()
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "full_state.pt"]
    loaded = run_program("dcp_reshard.py", 3, ["--load"], timeout=240,
                         workdir=tmp_path)
    assert loaded.returncode == 0, loaded.text()
    assert saved.report["checks"] == [] and not saved.report["loaded"]
    assert assert_report_agrees(loaded)["checks"] == [{
        "name": "saved by 2 ranks, loaded by 3", "ok": True, "saved_by": 2, "loaded_by": 3,
        "identical": 32, "tensors": 32}], loaded.text()
    assert any("rows per rank [7, 7, 6]" in line for line in loaded.lines())


REFUSALS = [
    ("tensor_parallel.py", [], {},
     "start it with torchrun: torchrun --standalone --nproc-per-node=2 tensor_parallel.py"),
    ("tensor_parallel.py", [], {"WORLD_SIZE": "3", "RANK": "0"},
     "--nproc-per-node=3: the 4 heads and 8 positions must split evenly over the ranks "
     "(use 1, 2 or 4)"),
    ("fsdp_tp_2d.py", [], {"WORLD_SIZE": "2", "RANK": "0"},
     "--nproc-per-node=2: this program needs 4 ranks (a 2x2 mesh): "
     "torchrun --standalone --nproc-per-node=4 fsdp_tp_2d.py"),
    ("dcp_reshard.py", ["--dir", "nowhere", "--load"], {"WORLD_SIZE": "3", "RANK": "0"},
     "--dir 'nowhere': no checkpoint there (save one first, without --load)"),
    ("dcp_reshard.py", ["--dir", "ckpt"], {"WORLD_SIZE": "5", "RANK": "0"},
     "--nproc-per-node=5: the batch of 12 must split evenly over the ranks that save "
     "(use 1, 2, 3, 4, 6 or 12)"),
    ("dcp_reshard.py", ["--dir", "missing/ckpt"], {"WORLD_SIZE": "2", "RANK": "0"},
     "--dir 'missing/ckpt': its parent directory does not exist"),
    *[(name, ["--report", "missing/r.json"], {"WORLD_SIZE": world, "RANK": "0"},
       "--report missing/r.json: no folder {folder}/missing")
      for name, world in (("tensor_parallel.py", "2"), ("fsdp_tp_2d.py", "4"), ("dcp_reshard.py", "2"))],
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, args, env, message", REFUSALS)
def test_programs_refuse_bad_input_in_one_line_before_starting(copies, name, args, env, message):
    """As a rank that torchrun started would see it (RANK, WORLD_SIZE), or without torchrun."""
    before = sorted(p.name for p in copies.iterdir())
    done = run_in_shell([PYTHON, name, *args], copies, timeout=100, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message.format(folder=copies) + "\n")
    assert sorted(p.name for p in copies.iterdir()) == before  # nothing written
