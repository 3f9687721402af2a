"""The replay's sum over 3 groups is gloo's, bit for bit: the order of a ring all-reduce."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ddpguide.failures import replay

SCRIPT = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
for size in map(int, sys.argv[1:]):
    t = torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(rank + size))
    dist.all_reduce(t)
    if rank == 0:
        torch.save(t, f"{size}.pt")
dist.destroy_process_group()
"""
SIZES = (7, 50, 165, 1000)


def flats(size: int) -> list[torch.Tensor]:
    return [torch.randn(size, dtype=torch.float64, generator=torch.Generator().manual_seed(r + size))
            for r in range(3)]


@pytest.mark.multiprocess
def test_ring_sum_is_what_gloo_computes_and_group_order_is_not(tmp_path):
    (tmp_path / "ring.py").write_text(SCRIPT)
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=3", "ring.py", *map(str, SIZES)], cwd=tmp_path,
                         env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stderr[-2000:]
    for size in SIZES:
        gloo = torch.load(tmp_path / f"{size}.pt")
        assert torch.equal(replay.ring_sum(flats(size)), gloo), size
    a, b, c = flats(1000)
    assert not torch.equal((a + b) + c, torch.load(tmp_path / "1000.pt"))   # the order shows


def test_the_sharded_ring_mean_puts_each_parameter_back_whole_from_its_padded_shards():
    """FT-HSDP, 3 groups of 2 ranks: a 5-row weight is cut 3 + 2 (+ 1 zero row); the mean
    put back together has each parameter's shape and is the groups' mean to the last bits."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=g, dtype=torch.float64) for p in model.parameters()]
             for _ in range(3)]
    mean = replay.sharded_ring_mean(model, grads, 2)
    assert [t.shape for t in mean] == [p.shape for p in model.parameters()]
    for i, t in enumerate(mean):
        plain = (grads[0][i] + grads[1][i] + grads[2][i]) / 3
        assert torch.allclose(t, plain, rtol=0, atol=1e-15), i
