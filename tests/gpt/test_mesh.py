"""Chapter 14: every process group of the GPT's mesh (the six axes, size-1 ones too, and
the flattened ones FSDP and the loss use) has the job's timeout, not c10d's default. One
rank, in this process: no process is started."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ddpguide.launch.programs import load


def test_every_group_of_the_mesh_has_the_job_s_timeout():
    parallelize = load("gpt/parallelize.py")
    timeout = datetime.timedelta(seconds=42)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=7))
    try:
        meshes = parallelize.build_mesh(parallelize.Layout(), "cpu", timeout)
        assert set(meshes) == {*parallelize.AXES, "world", "fsdp", "efsdp", "loss"}
        groups = [meshes[name].get_group(dim) for name in meshes for dim in range(meshes[name].ndim)]
        timeouts = {group._get_backend(torch.device("cpu")).options._timeout for group in groups}
        assert timeouts == {timeout}  # not the world group's 7 s: each group is a new one
    finally:
        dist.destroy_process_group()
