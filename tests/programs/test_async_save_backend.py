"""dcp.async_save refuses a process group without a CPU backend (an nccl-only job), and
accepts "cpu:gloo,cuda:<backend>", the string dcp_reshard.py starts its group with on GPUs.

No GPU here: a backend registered for CUDA only stands for nccl (async_save looks only at the
group's device types, torch/distributed/checkpoint/state_dict_saver.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.testing._internal.distributed.fake_pg import FakeProcessGroup

from tests.programs.programs_support import PROGRAMS, load_program

REFUSAL = ("A CPU backend must be enabled for async save; try initializing process group with "
           "'cpu:gloo,cuda:nccl'")


def _cuda_only(store, rank, size, timeout):  # the creator of a stand-in for nccl
    return FakeProcessGroup._create_internal(rank, size)


if "cudaonly" not in dist.Backend.backend_list:
    dist.Backend.register_backend("cudaonly", _cuda_only, devices=["cuda"])


@pytest.fixture
def group():
    def start(backend: str):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_async_save_refuses_a_group_without_a_cpu_backend(group, tmp_path):
    group("cudaonly")
    assert torch.device("cpu") not in dist.group.WORLD._device_types
    with pytest.raises(AssertionError) as caught:
        dcp.async_save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ckpt"))
    assert str(caught.value) == REFUSAL
    assert not (tmp_path / "ckpt").exists()


def test_async_save_accepts_gloo_beside_the_gpu_backend(group, tmp_path):
    group("cpu:gloo,cuda:cudaonly")
    future = dcp.async_save({"w": torch.arange(3.0)}, checkpoint_id=str(tmp_path / "ckpt"))
    future.result(timeout=60)
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(loaded["w"], torch.arange(3.0))


def test_dcp_reshard_starts_its_group_with_a_cpu_backend_on_gpus(monkeypatch):
    program = load_program(PROGRAMS / "dcp_reshard.py")
    for name, value in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert program.setup() == "cuda"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert program.setup() == "cpu"
    assert calls == ["cpu:gloo,cuda:nccl", "gloo"]
