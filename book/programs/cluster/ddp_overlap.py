"""DDP on a slow link: how much of the gradient all-reduce hides behind backward.

Run on each node K of 2 (one rank per node):
  GLOO_SOCKET_IFNAME=IF torchrun --nnodes 2 --nproc-per-node 1 --node-rank K \\
      --rdzv-endpoint NODE0_ADDR:29500 ddp_overlap.py --layer-ms 15 --report report.json

DDP puts the gradients into buckets of --bucket-mb megabytes (in reverse order of the
parameters, roughly the order backward produces them) and starts a bucket's all-reduce
as soon as its last gradient is ready, while backward goes on with earlier layers.
Timed, each the median of --steps samples (a sample is the slowest rank's time): the
forward alone; then, in rounds, a DDP step, a step under no_sync() (no all-reduce at all:
forward + backward compute), and DDP's buckets all-reduced alone (the same tensors,
launched the same way, with no backward around them). Whatever of the all-reduce backward
could not hide is step - compute ("exposed communication"): the median of that difference
over the rounds, the two steps of a round taken back to back so that both see the same
load on the machine. In this order every timed all-reduce starts on a link that has been
quiet for a step's compute, as DDP's does after backward.

--layer-ms makes each layer's backward take that many milliseconds more, waiting
rather than computing, as a GPU kernel of that length would leave the CPU free: on
a machine whose cores are shared, a wait keeps its length, where a computation
stretches with the load.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = datetime.timedelta(seconds=120)


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


class Wait(torch.autograd.Function):
    """The identity, whose backward waits ``seconds`` (a kernel of known length)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Layer(nn.Module):
    def __init__(self, width, wait_ms):
        super().__init__()
        self.linear, self.wait = nn.Linear(width, width), wait_ms / 1e3

    def forward(self, x):
        x = torch.relu(self.linear(x))
        return Wait.apply(x, self.wait) if self.wait > 0 else x


def synchronize(device):
    """Wait for the work queued on this rank's GPU: a collective or a kernel returns once it is
    launched, so a clock read before this would time the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work, device):
    """One run of ``work`` on every rank, after a barrier: the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    work()
    synchronize(device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def median_seconds(work, steps, device):
    return statistics.median(timed(work, device) for _ in range(steps))


def measure(args, bucket_mb, device, x):
    """Time one DDP model with buckets of ``bucket_mb`` MB (see the module's docstring)."""
    torch.manual_seed(0)
    layers = [Layer(args.width, args.layer_ms) for _ in range(args.layers)]
    model = DDP(nn.Sequential(*layers).to(device), bucket_cap_mb=bucket_mb)
    grad_bytes = sum(q.numel() * q.element_size() for q in model.parameters())

    def forward_only():
        with torch.no_grad():
            model(x)

    def compute_only():
        with model.no_sync():
            model(x).square().mean().backward()

    def ddp_step():
        model(x).square().mean().backward()

    for work in (compute_only, ddp_step, ddp_step):
        work()  # warm-up: DDP rebuilds its buckets in the order of the first backward
    # The buckets DDP built, in the order it all-reduces them (bytes each), and the same
    # all-reduces launched the same way (asynchronously, in that order) with nothing else.
    # The reducer's accessor is private: torch has no public one for the buckets DDP built,
    # and the public route, a comm hook, would replace the built-in all-reduce timed here.
    buckets = [b.buffer() for b in model.reducer._get_zeros_like_grad_buckets()]

    def buckets_alone():
        for work in [dist.all_reduce(torch.zeros_like(b), async_op=True) for b in buckets]:
            work.wait()

    buckets_alone()
    result = {"bucket_mb": bucket_mb, "grad_bytes": grad_bytes, "layer_ms": args.layer_ms,
              "buckets": [b.numel() * b.element_size() for b in buckets],
              "forward_seconds": median_seconds(forward_only, args.steps, device)}
    rounds = [(timed(ddp_step, device), timed(compute_only, device), timed(buckets_alone, device))
              for _ in range(args.steps)]
    for index, name in enumerate(("step", "compute", "comm")):
        result[f"{name}_seconds"] = statistics.median(r[index] for r in rounds)
    result["exposed_seconds"] = max(0.0, statistics.median(step - compute for step, compute, _ in rounds))
    return result


def write_report(path, report):
    """The report, written whole: a temporary file, then renamed (a file that exists is complete)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)


def main():
    p = argparse.ArgumentParser(description="exposed communication of DDP on a slow link")
    p.add_argument("--bucket-mb", default="0.0625,25", help="DDP's bucket_cap_mb, one run each")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layer-ms", type=float, default=0.0, help="added backward wait per layer")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--report", help="rank 0 writes the runs here, as JSON")
    args = p.parse_args()
    folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.report and not os.path.isdir(folder):
        p.exit(2, f"{p.prog}: error: argument --report: no folder {folder}\n")  # one line, no group
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    x = torch.randn(args.batch, args.width, device=device)
    runs = [measure(args, float(mb), device, x) for mb in args.bucket_mb.split(",")]
    if dist.get_rank() == 0:
        for run in runs:
            print(f"buckets of {run['bucket_mb']} MB ({len(run['buckets'])} buckets): compute "
                  f"{run['compute_seconds']:.3f} s, all-reduce alone {run['comm_seconds']:.3f} s, "
                  f"DDP step {run['step_seconds']:.3f} s, exposed {run['exposed_seconds']:.3f} s")
        if args.report:
            write_report(args.report, {"checks": [], "runs": runs})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
