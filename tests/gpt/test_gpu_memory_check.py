"""``make gpu-check``'s judgement of chapter 14's memory on CUDA (tools/gpu_nccl_checks.py,
which runs only where a GPU is lent), on reports made up here: it passes a run whose saved
bytes agree with the CUDA branch, and names each way one can be wrong."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).absolute().parents[2] / "tools" / "gpu_nccl_checks.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("gpu_nccl_checks", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(device="cuda", kernel="efficient", saved=1000, growth=1500):
    return {"predicted": {"device": device, "attention": kernel,
                          "memory": [{"gradients": 300, "activations": 1000, "unsharded": 0}]},
            "memory": [{"activations": saved, "cuda_peak_growth": growth}]}


def test_a_run_that_agrees_passes(tool, capsys):
    assert tool.judge_memory("efficient", report()) == ""
    assert "allocator peak above the start 1.15 x predicted" in capsys.readouterr().out


@pytest.mark.parametrize("changes,problem", [
    ({"device": "cpu", "kernel": "cpu"}, "efficient: predicted for cpu, cpu"),
    ({"kernel": "math"}, "efficient: predicted for cuda, math"),
    ({"saved": 1100}, "efficient: activations measured / predicted 1.100"),
    ({"growth": 900}, "efficient: max_memory_allocated grew 900 B, below the 1000 B kept"),
    ({"growth": None}, "efficient: max_memory_allocated grew None B"),
])
def test_each_disagreement_is_named(tool, changes, problem):
    assert tool.judge_memory("efficient", report(**changes)).startswith(problem)
