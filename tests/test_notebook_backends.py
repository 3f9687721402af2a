"""The notebook workers of chapters 1 and 5 start their group on the backend their devices
need, whatever the machine shows (device counts simulated): chapter 5's DDP over a model in two
parts takes nccl only where every rank gets two GPUs, and chapter 1's workers, whose models are
on the CPU, are gloo everywhere (spawn left to itself picks nccl wherever a GPU per rank is
visible, and an nccl group cannot reduce CPU tensors)."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpguide.core.runtime import select_runtime

BOOK = Path(__file__).resolve().parents[1] / "book"


def code_cells(chapter: str) -> list[str]:
    cells = json.loads((BOOK / chapter).read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def written_module(chapter: str, name: str) -> types.ModuleType:
    """The module a %%writefile cell writes (``{WORKERS}/name.py``), loaded."""
    cell = next(c for c in code_cells(chapter) if c.startswith("%%writefile") and f"/{name}.py" in c)
    module = types.ModuleType(name)
    exec(compile(cell.split("\n", 1)[1], f"{chapter}:{name}.py", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("gpus, backend", [(0, "gloo"), (2, "gloo"), (3, "gloo"), (4, "nccl")])
def test_chapter_5_s_ddp_over_two_parts_follows_its_devices(monkeypatch, gpus, backend):
    worker = written_module("05_model_parallel.ipynb", "ddp_model_parallel")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    assert worker.backend_for(2) == backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    devices = [worker.my_devices(rank, 2) for rank in range(2)]
    chosen = select_runtime(2, backend=worker.backend_for(2))
    if backend == "nccl":  # two GPUs of its own per rank, all of them visible
        assert devices == [(torch.device("cuda", 0), torch.device("cuda", 1)),
                           (torch.device("cuda", 2), torch.device("cuda", 3))]
        assert chosen.device_type == "cuda"
    else:
        assert {d.type for pair in devices for d in pair} == {"cpu"} and chosen.device_type == "cpu"
    cell = next(c for c in code_cells("05_model_parallel.ipynb") if "spawn(ddp_model_parallel.train" in c)
    assert "backend=ddp_model_parallel.backend_for(2)" in cell


def test_chapter_1_s_workers_are_gloo_on_any_machine(monkeypatch):
    calls = [node for cell in code_cells("01_spawn_ddp.ipynb") if not cell.startswith("%%")
             for node in ast.walk(ast.parse(cell))
             if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "spawn"]
    assert len(calls) >= 7
    for call in calls:
        assert [ast.unparse(k.value) for k in call.keywords if k.arg == "backend"] == ["BACKEND"]
    assert any('BACKEND = "gloo"' in cell for cell in code_cells("01_spawn_ddp.ipynb"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_runtime(2).backend == "nccl"  # what spawn would pick left to itself
    assert select_runtime(2, backend="gloo").device_type == "cpu"
