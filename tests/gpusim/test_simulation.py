"""The simulated GPU machine (``ddpguide.core.gpusim``, with
``ddpguide.core.gpusim_state``, ``ddpguide.core.gpusim_placement``, ``ddpguide.core.gpusim_nccl``,
``ddpguide.core.gpusim_syncbn`` and the ``ddpguide.core.gpusim_site.sitecustomize`` that every process started with
:func:`gpusim.environment` runs) refuses each hazard as nccl or a GPU
would: a host tensor, another device's tensor, two ranks on one GPU, a module left on the
host under DDP, a timer read while GPU work is queued."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpguide.core import gpusim

# A process that leaves a gloo group alive calls exit() while gloo's threads still run (its
# tcp loop wakes every 10 ms), and now and then static destruction meets one of them: the
# process aborts ("terminate called without an active exception", status -6), about once in
# 50-100 runs here. Every program below therefore ends its group, also when it raises.
ONE_RANK = """\
import atexit
import time
import torch
import torch.distributed as dist
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
device = torch.device("cuda", 0)
"""


def python(tmp_path, source: str, gpus: int = 2, env: dict[str, str] | None = None,
           argv: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    (tmp_path / "program.py").write_text(source)
    environ = gpusim.environment(gpus, tmp_path / "gpusim.log")
    environ.update(env or {})
    return subprocess.run([sys.executable, *argv, "program.py"], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=240)


def findings(tmp_path) -> list[dict]:
    log = tmp_path / "gpusim.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("gpus,visible,seen", [(1, None, 1), (2, None, 2), (8, None, 8),
                                               (8, "3,5", 2), (2, "", 0), (2, "1,7", 1)])
def test_the_device_count_and_the_backend_follow_the_simulated_machine(tmp_path, gpus, visible, seen):
    source = ("import torch\nfrom ddpguide.core.runtime import select_runtime\n"
              "print(torch.cuda.is_available(), torch.cuda.device_count(), select_runtime(1).backend)\n")
    done = python(tmp_path, source, gpus, env=None if visible is None else {"CUDA_VISIBLE_DEVICES": visible})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(seen > 0), str(seen), "nccl" if seen else "gloo"]


def test_placed_tensors_report_their_device_and_results_follow_them(tmp_path):
    done = python(tmp_path, ONE_RANK + (
        "m = torch.nn.Linear(2, 2).to(device)\n"
        "y = m(torch.ones(1, 2, device='cuda:0')) * 2\n"
        "print(torch.zeros(1, device='cuda:1').device, m.weight.device, y.device, y.is_cuda,"
        " y.cpu().device, torch.ones(1).device, dist.get_backend())\n"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cuda:1", "cuda:0", "cuda:0", "True", "cpu", "cpu", "nccl"]


@pytest.mark.parametrize("call", ["dist.all_reduce(torch.ones(2))",
                                  "dist.all_gather([torch.zeros(2, device=device)], torch.ones(2))",
                                  "dist.broadcast(torch.ones(2, device=device).cpu(), 0)",
                                  "funcol.all_reduce(torch.ones(2), 'sum', dist.group.WORLD)"])
def test_a_host_tensor_is_refused_with_nccls_words(tmp_path, call):
    done = python(tmp_path, ONE_RANK + "import torch.distributed._functional_collectives as funcol\n"
                  + call + "\n")
    assert done.returncode == 1
    assert "RuntimeError: No backend type associated with device type cpu" in done.stderr


def test_a_host_tensor_passes_on_gloo(tmp_path):
    done = python(tmp_path, ONE_RANK.replace('"nccl"', '"gloo"') + "dist.all_reduce(torch.ones(2))\n")
    assert done.returncode == 0, done.stderr


def test_another_devices_tensor_is_refused(tmp_path):
    done = python(tmp_path, ONE_RANK + "dist.all_reduce(torch.ones(2, device=device))\n"
                  "dist.all_reduce(torch.ones(2, device='cuda:1'))\n")
    assert done.returncode == 1
    assert "Tensor found on device cuda:1 but backend constrained to cuda:0" in done.stderr


def test_ddp_refuses_a_module_left_on_the_host(tmp_path):
    source = ONE_RANK + "from torch.nn.parallel import DistributedDataParallel as DDP\n{}\n"
    placed = python(tmp_path, source.format("DDP(torch.nn.Linear(2, 2).to(device), device_ids=[0])"))
    assert placed.returncode == 0, placed.stderr
    host = python(tmp_path, source.format("DDP(torch.nn.Linear(2, 2))"))
    assert "No backend type associated with device type cpu" in host.stderr


TWO_RANKS = """\
import os
import torch
import torch.distributed as dist
dist.init_process_group("nccl")
device = torch.device("cuda", {index})
dist.all_reduce(torch.ones(2, device=device))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("index,refused", [("int(os.environ['LOCAL_RANK'])", False), ("0", True)])
def test_two_ranks_on_one_gpu_are_refused_under_torchrun(tmp_path, index, refused):
    done = python(tmp_path, TWO_RANKS.format(index=index),
                  argv=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"))
    assert (done.returncode != 0) == refused, done.stderr
    assert ("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0" in done.stderr
            or "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 0" in done.stderr) == refused


TIMED = ONE_RANK + """\
x = torch.ones(4, device=device)
start = time.perf_counter()
dist.all_reduce(x)
{wait}
took = time.perf_counter() - start
"""


@pytest.mark.parametrize("wait,reported", [("", True), ("torch.cuda.synchronize()", False),
                                           ("x.sum().item()", False)])
def test_a_timer_that_never_waits_for_the_gpu_is_reported(tmp_path, wait, reported):
    done = python(tmp_path, TIMED.format(wait=wait))
    assert done.returncode == 0, done.stderr
    timers = [f["message"] for f in findings(tmp_path) if f["kind"] == "timer"]
    assert bool(timers) == reported, timers
    if reported:
        assert timers[0].startswith(f"{tmp_path}/program.py:12: the clock is read while GPU work is queued")


def test_cuda_only_calls_are_stubs_and_events_time(tmp_path):
    done = python(tmp_path, ONE_RANK + (
        "torch.cuda.set_device(1)\n"
        "print(torch.cuda.current_device(), torch.cuda.max_memory_allocated(), torch.ones(1, device='cuda').device)\n"
        "a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
        "a.record(); time.sleep(0.05); b.record(); b.synchronize()\n"
        "print(a.elapsed_time(b) >= 50)\n"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0", "cuda:1", "True"]


def test_a_count_that_is_not_a_number_is_refused(tmp_path):
    done = python(tmp_path, "print('ran')\n", env={gpusim.ENV: "two"})
    assert done.returncode == 2
    assert done.stderr == "DDPGUIDE_SIMULATE_GPUS='two' is not a GPU count\n"
    assert done.stdout == ""


def test_torch_compile_traces_on_the_simulated_machine(tmp_path):
    """Dynamo asks whether a CUDA stream is capturing and which stream is current before it
    traces a frame, and keeps one handler per stream function: the stubs answer all three."""
    done = python(tmp_path, (
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
        "x = torch.randn(4, 8)\n"
        "print(torch.equal(torch.compile(m, backend='aot_eager')(x), m(x)))\n"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"]


def test_torchfts_stream_and_device_calls_answer_as_on_a_gpu(tmp_path):
    """torchft 0.2.0's Manager makes ``torch.Stream()`` streams, sets the device index back
    after a quorum and asserts that the current stream is the one it began with; its DiLoCo
    records a ``torch.Event()`` at each sync."""
    done = python(tmp_path, (
        "import torch\n"
        "s = torch.Stream(torch.accelerator.current_accelerator())\n"
        "print(s.device, torch.Stream().device, isinstance(s, torch.Stream),"
        " isinstance(torch.Stream('cpu'), torch.Stream), torch.Stream('cpu').device)\n"
        "zero = torch.accelerator.current_stream()\n"
        "torch.accelerator.set_device_index(1)\n"
        "one = torch.accelerator.current_stream()\n"
        "print(torch.accelerator.current_device_index(), one.device, one is torch.cuda.current_stream(),"
        " one == torch.accelerator.current_stream(), one == zero, s == torch.Stream())\n"
        "e = torch.Event()\n"
        "e.record(); e.synchronize()\n"
        "print(e.device, isinstance(e, torch.Event), e.query(), torch.Event('cpu').device)\n"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["cuda:0", "cuda:0", "True", "True", "cpu",
                                   "1", "cuda:1", "True", "True", "False", "False",
                                   "cuda:1", "True", "True", "cpu"]


def test_an_eager_module_under_torch_compile_compiles_no_graph_of_the_simulation(tmp_path):
    """Each torch call of an eager module enters the simulation's torch-function mode: its
    frame must not become a graph of Dynamo's (chapter 1 asserts none for DDP(nn.Sequential)),
    while a module of user code still compiles, with the mode inlined."""
    done = python(tmp_path, (
        ONE_RANK.replace('"nccl"', '"gloo"') +
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "graphs = []\n"
        "def count(gm, inputs):\n"
        "    graphs.append(gm)\n"
        "    return gm.forward\n"
        "class User(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.relu(x) * 2\n"
        "torch.compile(DDP(torch.nn.Sequential(torch.nn.Linear(4, 4))), backend=count)(torch.ones(2, 4))\n"
        "print(len(graphs))\n"
        "y = torch.compile(User(), backend=count)(torch.ones(2, device=device))\n"
        "print(y.device, y.sum().item(), len(graphs))\n"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "cuda:0", "4.0", "1"]


GPU_ONLY_PARTS = """\
import copy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from ddpguide.core.mesh import mesh_device
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
device = torch.device("cuda", rank)
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, 1))
whole_net = copy.deepcopy(net)  # one process, plain BatchNorm, both ranks' batches at once
batches = [torch.randn(2 * r + 4, 1, 6, 6, generator=torch.Generator().manual_seed(r)) for r in range(2)]
model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device), device_ids=[rank])
out = model(batches[rank].to(device))
out.square().sum().backward()
whole = whole_net(torch.cat(batches))
(whole[:4].square().sum() + whole[4:].square().sum()).backward()
sync, plain = model.module[1], whole_net[1]
gaps = [(a.grad - b.grad / 2).abs().max() for a, b in zip(model.module.parameters(), whole_net.parameters())]
gaps += [(sync.running_mean - plain.running_mean).abs().max(), (sync.running_var - plain.running_var).abs().max(),
         (out - whole[:4] if rank == 0 else out - whole[4:]).abs().max()]
seen = [f"{type(sync).__name__} {out.device} {max(g.item() for g in gaps) < 1e-5}"]
mesh = init_device_mesh("cuda", (1, 2), mesh_dim_names=("dp", "tp"))
shards = distribute_tensor(torch.arange(4.0, device="cuda"), mesh["tp"], [Shard(0)])
whole = shards.redistribute(mesh["tp"], [Replicate()]).full_tensor()
seen.append(f"{mesh.device_type} {mesh['tp'].device_type} {mesh_device(mesh['tp'])} {shards.device} "
            f"{shards.to_local().device} {whole.device} {whole.tolist() == [0.0, 1.0, 2.0, 3.0]}")
with open(f"rank{rank}.txt", "w") as f:  # a file each: the ranks' stdout would interleave
    f.write("\\n".join(seen))
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_sync_batch_norm_and_a_cuda_mesh_run_on_simulated_gpus_as_on_gpus(tmp_path):
    """torch's SyncBatchNorm runs on GPUs only (DDP's check, forward's, five CUDA kernels): on
    simulated ones it trains as batch norm over both ranks' batches (4 and 6 images): outputs,
    gradients and running statistics. A CUDA mesh runs as a CPU one; the code outside torch
    sees it, its sub-meshes and its DTensors on the rank's GPU (chapter 9 takes its device
    from the mesh)."""
    done = python(tmp_path, GPU_ONLY_PARTS, argv=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text().splitlines() == [
            f"SyncBatchNorm cuda:{r} True", f"cuda cuda cuda:{r} cuda:{r} cuda:{r} cuda:{r} True"]


def test_sync_batch_norm_on_the_host_is_still_refused_and_a_loader_pins_in_its_thread(tmp_path):
    """A DataLoader with a worker pins its batches in a thread of its own, outside the
    placement mode (pinning reached CUDA: "Found no NVIDIA driver"); SyncBatchNorm in a module
    or on an input left on the host is refused as on a GPU machine."""
    done = python(tmp_path, ONE_RANK.replace('"nccl"', '"gloo"') + (
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "loader = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2, pin_memory=True, num_workers=1)\n"
        "print([b[0].to(device).device for b in loader] == [device, device])\n"
        "bn = torch.nn.SyncBatchNorm(2)\n"
        "try:\n"
        "    DDP(torch.nn.Sequential(torch.nn.Linear(2, 2), bn))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "try:\n"
        "    bn(torch.ones(3, 2))  # a host input, in training, with a process group\n"
        "except ValueError as error:\n"
        "    print(error)\n"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True", "SyncBatchNorm layers only work with GPU modules",
                                        "SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone"]
