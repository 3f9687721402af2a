"""Chapters' own cells on the simulated GPU machine (``ddpguide.core.gpusim``): the cells a
check needs, taken from the notebook as committed, run as one script with the machine's GPU
count simulated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide.core import gpusim

pytestmark = pytest.mark.multiprocess
BOOK = Path(__file__).resolve().parents[2] / "book"


def cells(notebook: str, *starts: str) -> str:
    """The code cells of ``notebook`` that begin with each of ``starts`` (the first code cell
    for ""), joined in that order."""
    code = ["".join(c["source"]) for c in json.loads((BOOK / notebook).read_text())["cells"]
            if c["cell_type"] == "code"]
    return "\n\n".join(next(c for c in code if c.startswith(start)) for start in starts)


def cell_with(notebook: str, text: str) -> str:
    """The first code cell of ``notebook`` that holds ``text``."""
    return next(s for s in ("".join(c["source"]) for c in
                            json.loads((BOOK / notebook).read_text())["cells"] if c["cell_type"] == "code")
                if text in s)


def run_cells(tmp_path: Path, gpus: int, source: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "cells.py").write_text(source)
    return subprocess.run([sys.executable, str(tmp_path / "cells.py")], cwd=BOOK,
                          env={**gpusim.environment(gpus), **env}, capture_output=True, text=True,
                          timeout=300)


def test_chapter_10_exercise_5_reads_a_doctor_report_on_one_gpu(tmp_path):
    """N10.3: with one GPU the doctor's run stops before its collectives (two local ranks,
    one GPU), and the exercise's check read its empty "links" (KeyError)."""
    done = run_cells(tmp_path, 1, cells("10_debugging.ipynb", "", "started = time.perf_counter()",
                                        "# Check: the JSON the doctor wrote"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exit status 1" in done.stdout and "GPUs visible but this job would run on CPU" in done.stdout
    assert "slowest link 0 -> 1" in done.stdout or "slowest link 1 -> 0" in done.stdout


def test_chapter_7s_one_process_comparison_runs_on_a_gpu_without_bfloat16(tmp_path):
    """N7.2: on a GPU older than Ampere resolve_amp refuses bfloat16, and the chapter stopped
    at its one-process bf16 run."""
    before = "import types\nprogram_accuracy, program = 0.0, types.SimpleNamespace(seconds=0.0)\n"
    done = run_cells(tmp_path, 2, "\n\n".join([cells("07_amp.ipynb", ""), before,
                                                 cell_with("07_amp.ipynb", '"1 process, bf16": fit(')]),
                     **{gpusim.BF16_ENV: "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "backend=nccl, device=cuda" in done.stdout
    assert "1 process, bf16" in done.stdout
