"""Two pipeline stages with torch.distributed.pipelining and GPipe, checked against one process.

A small MLP (nn.Sequential) is cut in two: rank 0 keeps the first half, rank 1 the
second. Each half becomes a PipelineStage; ScheduleGPipe splits every batch into
micro-batches, runs all their forward passes (rank 0 sends activations to rank 1),
then all their backward passes (rank 1 sends gradients back). The last stage computes
the loss of each micro-batch; the schedule divides the accumulated gradients by the
number of micro-batches (scale_grads=True), so they equal the gradients of the mean
loss over the whole batch. Every rank also keeps a copy of the whole model, trains it
in one process on the same batches, and after each step compares its stage's
gradients and, on the last stage, the loss. Lines are prefixed with the rank.

Run:  torchrun --standalone --nproc-per-node=2 pipeline_pipelining.py
      torchrun --standalone --nproc-per-node=2 pipeline_pipelining.py --microbatches 8

From the source (the PyTorch model-parallel tutorial): its PipelineParallelResNet50
overlaps micro-batches inside one process through CUDA's asynchronous kernels, so it
needs two GPUs and pipelines the forward pass only. Here each stage is a process, on
a GPU or a CPU, and the schedule pipelines both passes.
"""

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

STAGES = 2
SPLIT = 4  # layers 0-3 on rank 0, layers 4-7 on rank 1


def build_model() -> nn.Sequential:
    """The same MLP on every rank (seeded), 16 inputs to 4 outputs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4), nn.Tanh())


def batch(step: int, size: int):
    """Inputs and targets of one step, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 16, generator=g), torch.rand(size, 4, generator=g) * 2 - 1


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


def main(args):
    rank = int(os.environ["RANK"])
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    model = build_model().to(device)
    reference = copy.deepcopy(model)  # the whole model, trained in this one process
    part = model[:SPLIT] if rank == 0 else model[SPLIT:]  # keeps the layer names "0".."7"
    stage = PipelineStage(part, stage_index=rank, num_stages=STAGES, device=device)
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=args.lr)
    worst = 0.0
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(step, args.batch_size))
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)  # the first stage feeds the inputs
        else:
            losses = []
            schedule.step(target=y, losses=losses)  # the last stage holds targets and losses
        reference_optimizer.zero_grad()
        reference_loss = F.mse_loss(reference(x), y)
        reference_loss.backward()
        gradient_gap = max((p.grad - reference.get_parameter(name).grad).abs().max().item()
                           for name, p in part.named_parameters())
        worst = max(worst, gradient_gap)
        line = f"[rank {rank}] step {step}: stage {rank} gradients vs one process, " \
               f"max difference {gradient_gap:.1e}"
        if rank == STAGES - 1:
            loss = torch.stack(losses).mean()  # equal micro-batches: the mean of their losses
            worst = max(worst, abs(loss - reference_loss).item())
            line += f"; loss {loss.item():.6f} vs {reference_loss.item():.6f}"
        print(line + "\n", end="", flush=True)  # one write, so the ranks' lines never mix
        optimizer.step()
        reference_optimizer.step()
    verdict = torch.tensor([worst <= args.tolerance], dtype=torch.int, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every rank must agree
    if rank == 0:
        print(f"pipeline matches one process within {args.tolerance:g}: {bool(verdict.item())}",
              flush=True)
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="A two-stage GPipe pipeline, checked against one process.")
    parser.add_argument("--batch-size", type=int, default=64, help="per step (default 64)")
    parser.add_argument("--microbatches", type=int, default=4, help="per batch (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD step (default 0.1)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest difference accepted (default 1e-5)")
    args = parser.parse_args()
    for name in ("batch_size", "microbatches", "steps", "lr", "tolerance"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"argument --{name.replace('_', '-')}: expected a value > 0, "
                         f"got {getattr(args, name)}")
    if args.batch_size % args.microbatches:
        parser.error(f"argument --microbatches: {args.microbatches} does not divide "
                     f"--batch-size {args.batch_size}")
    if os.environ.get("WORLD_SIZE") != str(STAGES) or "LOCAL_RANK" not in os.environ:
        parser.error(f"needs {STAGES} ranks (WORLD_SIZE={os.environ.get('WORLD_SIZE')}): start "
                     f"me with torchrun --standalone --nproc-per-node={STAGES} {parser.prog}")
    return args


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
