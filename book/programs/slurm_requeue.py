"""Training a scheduler may stop at any step: it checkpoints when told to stop and resumes there.

Run by chapter 18's batch script, on every node, under torchrun:

    PROGRAM=book/programs/slurm_requeue.py sbatch --requeue cluster/slurm_torchrun.sbatch \
        --epochs 4 --step-seconds 0.1 --report done.json

Run by hand on one machine: torchrun --standalone --nproc-per-node=2 slurm_requeue.py
(then `kill -TERM` a worker: every rank stops after the step, and the next run resumes).
Source: written for this book, no article behind it; rank_device() is ddp_torchrun.py's.

When Slurm takes a job's nodes back (``scontrol requeue JOB``, a preemption, the
warning before a time limit that the batch script turns into a requeue) it sends
SIGTERM to every process of the job; torchrun passes it to its workers too. The
handler here only sets a flag. After every step the ranks agree, with one
all_reduce (MAX), whether any of them was told to stop: all stop after the same
step, rank 0 saves the model, the optimizer and the position (epoch, step within
it) with an atomic rename, and the workers exit. The next allocation loads the
checkpoint, skips the batches of the epoch already trained, and goes on; the
result is the same model as a run that was never stopped, bit for bit.

A node lost mid-job cannot save anything: the job resumes from the last
checkpoint (one at the end of every epoch), and the steps after it are trained
again. The checkpoint keeps the history of the allocations (Slurm's job id and
restart count, the steps each saved), which the report shows.

``--report FILE`` (rank 0, at the end): ``checks``; ``history`` (one entry per
allocation that saved: ``restart``, ``from`` and ``to`` global steps, ``why``,
``started_at``, the wall-clock time its training began, after loading the checkpoint);
``steps``; ``epochs``; ``params_sha256`` (of the final parameters' bytes);
``accuracy``.
"""

import argparse
import hashlib
import json
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

STOP = {"asked": False}


def ask_to_stop(signum, frame):
    STOP["asked"] = True  # acted on after the step in progress, by every rank together


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


def digits():
    """scikit-learn's 8x8 digits (shipped with it, nothing downloaded): 1437 train, 360 test."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    return TensorDataset(x[:1437], y[:1437]), TensorDataset(x[1437:], y[1437:])


def save(path, model, optimizer, epoch, step, history):
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": epoch, "step": step, "history": history}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a kill mid-save leaves the previous checkpoint whole


def train(args, rank, world, device):
    train_set, test_set = digits()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epoch, step, history = 0, 0, []
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, step, history = state["epoch"], state["step"], state["history"]
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    per_epoch = len(loader)
    first = epoch * per_epoch + step
    mine = {"job": os.environ.get("SLURM_JOB_ID"), "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            "rank0_host": socket.gethostname(), "from": first, "to": first, "why": "started",
            "started_at": time.time()}  # the checkpoint loaded, training about to go on
    print(f"rank {rank}: on {socket.gethostname()}, starting at epoch {epoch} step {step} "
          f"(restart {mine['restart']})", flush=True)
    model = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    flag = torch.zeros(1, device=device)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        for k, (x, y) in enumerate(loader):
            if k < step:
                continue  # trained by an earlier allocation
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            time.sleep(args.step_seconds)  # a longer step, so a stop lands mid-epoch
            step = k + 1
            flag.fill_(1.0 if STOP["asked"] else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                mine.update(to=epoch * per_epoch + step, why="signal")
                if rank == 0:
                    save(args.checkpoint, model.module, optimizer, epoch, step, [*history, mine])
                print(f"rank {rank}: stopped after epoch {epoch} step {step}, checkpoint saved", flush=True)
                return None
        epoch, step = epoch + 1, 0
        mine.update(to=epoch * per_epoch, why="epoch")
        if rank == 0:
            save(args.checkpoint, model.module, optimizer, epoch, 0, [*history, mine])
        print(f"rank {rank}: epoch {epoch - 1} done", flush=True)
    history = [*history, mine]
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (model.module(x.to(device)).argmax(1).cpu() == y).float().mean().item()
    params = torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu()
    return {"history": history, "steps": args.epochs * per_epoch, "epochs": args.epochs,
            "accuracy": accuracy, "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
            "checks": history_checks(history, args.epochs * per_epoch)}


def history_checks(history, steps):
    """The allocations' saved ranges join up, from step 0 to the last: no step lost or repeated."""
    chain = all(a["to"] == b["from"] for a, b in zip(history, history[1:]))
    return [{"name": "each allocation starts where the last save ended", "ok": chain},
            {"name": "every step trained into the model once",
             "ok": chain and history[0]["from"] == 0 and history[-1]["to"] == steps}]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="DDP training that checkpoints on SIGTERM and resumes mid-epoch.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--checkpoint", default="requeue.pt")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="rank 0 writes the report here (JSON) at the end")
    args = parser.parse_args()
    if not 0 < args.epochs < 1000 or not 0 < args.batch_size <= 1437:
        parser.error(f"argument --epochs/--batch-size: out of range ({args.epochs}, {args.batch_size})")
    if not 0 <= args.step_seconds < math.inf:
        parser.error(f"argument --step-seconds: expected a value >= 0, got {args.step_seconds}")
    if "RANK" not in os.environ:
        parser.error("RANK is not set: start me with torchrun")
    return args


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, ask_to_stop)
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = train(args, rank, world, device)
        if result is not None and rank == 0 and args.report:
            with open(args.report + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(args.report + ".tmp", args.report)
            for check in result["checks"]:
                print(f"check: {check['name']}: {'OK' if check['ok'] else 'FAILED'}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
