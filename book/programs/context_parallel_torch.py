"""PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel).

Inside the context, q, k and v are cut along the sequence (dimension 2) over the mesh, the
head-tail (zig-zag) split whenever load balancing is on (its default) and the sequence
divides into 2 x ranks chunks, causal or not, and every call of
F.scaled_dot_product_attention becomes a ring over the ranks. The program compares the
output and the gradients with full attention on the whole sequence in one process, and
fails (exit status 1) beyond TOLERANCE.

On CPU it stops with the library's error (printed in one line, exit status 1): the ring is
written for the GPU kernels of SDPA only (flash, memory-efficient, cuDNN).

Run:  torchrun --standalone --nproc-per-node=2 context_parallel_torch.py
      torchrun --standalone --nproc-per-node=2 context_parallel_torch.py --math
                (SDPA's math kernel forced: composite operations on sharded tensors)

Source: PyTorch's context-parallel tutorial (unstable), checked here on the backward too.
"""

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import (
    _HeadTailLoadBalancer,  # the head-tail split that context_parallel uses by default
    context_parallel_unshard,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

BATCH, HEADS, SEQ, HEAD_DIM = 1, 4, 64, 16
# The largest |difference| from full attention accepted, over the largest |value| of the
# tensor (or 1, if that is smaller): bfloat16 keeps 8 bits of mantissa (a relative step of
# 2^-8 = 3.9e-3, so an ulp grows with the value: 1.6e-2 at 3) and the ring adds the blocks in
# another order than one kernel does; float64 (the CPU with --math) agrees to rounding.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float64: 1e-10}


def rank_device() -> torch.device:
    """This rank's GPU, or the CPU where ranks would have to share one (nccl refuses that).

    GPU LOCAL_RANK when this machine shows one per local rank; cuda:0 when the launcher
    left this rank exactly one (CUDA_VISIBLE_DEVICES names one device: srun --gpus-per-task=1,
    torchrun --virtual-local-rank). A torchrun worker other than local rank 0 that sees one
    listed GPU shares it (torchrun passes its CUDA_VISIBLE_DEVICES to every worker
    unchanged): refused in one line, since rank 0 takes that GPU with nccl.
    """
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if gpus == 1 and len(visible) == 1:
        if local_rank > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            print(f"{gpus} GPU visible to every one of {local_ranks} local ranks: nccl needs a GPU "
                  "of its own for each rank (run one rank per GPU, give each its own with torchrun "
                  "--virtual-local-rank, or hide it with CUDA_VISIBLE_DEVICES= to run on the CPU)",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def scaled_difference(actual, expected):
    """max |actual - expected| over max(1, max |expected|): rounding relative to the values."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1)).item()


def within_tolerance(worst, dtype):
    """Whether every scaled difference (out, dq, dk, dv) is within the dtype's TOLERANCE."""
    return max(worst) <= TOLERANCE[dtype]


def main():
    kernel = (sdpa_kernel(SDPBackend.MATH) if "--math" in sys.argv[1:]
              else contextlib.nullcontext())  # without --math: the kernel SDPA picks
    if set(sys.argv[1:]) - {"--math"}:
        print(f"unknown argument {(set(sys.argv[1:]) - {'--math'}).pop()!r} (the only option "
              "is --math)", file=sys.stderr)
        return 2
    if "WORLD_SIZE" not in os.environ:
        print("start it with torchrun: torchrun --standalone --nproc-per-node=2 "
              "context_parallel_torch.py", file=sys.stderr)
        return 2
    rank_gpu = rank_device()
    use_gpu = rank_gpu.type == "cuda"
    device = rank_gpu.type
    if use_gpu:
        torch.cuda.set_device(rank_gpu)
    dist.init_process_group("nccl" if use_gpu else "gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    dtype = torch.bfloat16 if use_gpu else torch.float64  # the GPU kernels take no float64
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator).to(device, dtype)
                     for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True)
    expected.backward(dout)
    # The buffers are resized in place to this rank's shard (and back at the end): tensors
    # without autograd history; the leaves that need gradients are made inside.
    shards = [t.clone() for t in (q, k, v, dout)]
    try:
        with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2, 2]):
            mine = [t.detach().requires_grad_() for t in shards[:3]]
            with kernel:
                out = F.scaled_dot_product_attention(*mine, is_causal=True)
            out.backward(shards[3])
            local = [out.detach(), *(t.grad for t in mine)]
    except Exception as error:  # noqa: BLE001 -- the library's error is the lesson on CPU
        if dist.get_rank() == 0:
            print(f"context_parallel on {device}: {type(error).__name__}: {error}", flush=True)
        dist.destroy_process_group()
        return 1
    balancer = _HeadTailLoadBalancer(SEQ, world, torch.device(device))
    whole = context_parallel_unshard(mesh, local, [2, 2, 2, 2], load_balancer=balancer)
    worst = torch.tensor([scaled_difference(a, b) for a, b in
                          zip(whole, (expected, *(t.grad for t in full)))], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = within_tolerance(worst.tolist(), dtype)
    if dist.get_rank() == 0:
        print(f"{world} ranks, {dtype}: max |context_parallel - full| / max(1, max |full|), out, dq, dk, dv: "
              f"{[f'{x:.1e}' for x in worst.tolist()]} (<= {TOLERANCE[dtype]:g}): "
              f"{'OK' if ok else 'FAILED'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
