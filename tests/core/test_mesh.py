"""``ddpguide.core.mesh``: meshes whose sub-groups keep the job's timeout; private API that warns."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddpguide.core import mesh


def test_the_world_timeout_reaches_every_mesh_dimension(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=42))
    try:
        override = mesh.subgroup_backends(2)
        assert [backend for backend, _ in override] == ["gloo", "gloo"]
        assert {options._timeout for _, options in override} == {datetime.timedelta(seconds=42)}
        grid = mesh.device_mesh((1, 1), ("dp", "tp"))
        assert grid.mesh_dim_names == ("dp", "tp") and grid.device_type == "cpu"
        assert mesh.device_mesh((1,)).get_group() is dist.group.WORLD  # the world group itself
        with pytest.raises(ValueError, match=r"mesh \(2, 1\) needs 2 ranks but the world has only 1"):
            mesh.device_mesh((2, 1))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("group, missing", [
    (object(), "_get_backend"),                                      # the group's method is gone
    (SimpleNamespace(_get_backend=lambda device: SimpleNamespace(options=object())), "_timeout"),
])
def test_a_private_name_that_is_gone_warns_and_names_it(group, missing):
    with pytest.warns(RuntimeWarning, match=f"has no '{missing}'.*fall back to c10d's default "
                                            r"timeout \(30 min for gloo, 10 for nccl\)"):
        assert mesh.subgroup_backends(2, group=group, backend="gloo", device_type="cpu") is None


def test_a_mesh_needs_a_process_group():
    with pytest.raises(ValueError, match="no process group: run inside ddpguide.launch.spawn"):
        mesh.device_mesh((2,))


def test_mesh_device_is_the_mesh_s_device_type_and_without_one_the_process_s(monkeypatch):
    monkeypatch.setattr(mesh, "worker_device", lambda: torch.device("cpu"))  # gloo's rank
    assert mesh.mesh_device() == mesh.mesh_device(SimpleNamespace(device_type="cpu")) == torch.device("cpu")
    # the mesh's device type, not the process's
    assert mesh.mesh_device(SimpleNamespace(device_type="meta")) == torch.device("meta")
