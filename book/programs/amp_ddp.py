"""Mixed-precision DDP: autocast, a GradScaler saved and restored, SyncBatchNorm where it works.

A ConvNet with BatchNorm learns scikit-learn's 8x8 digits on 2 ranks started by
mp.spawn. The forward pass and the loss run under torch.autocast: float16 on CUDA,
bfloat16 on CPU (--dtype to choose). A GradScaler guards float16 gradients against
underflow; it is enabled for float16 only (bfloat16 has float32's exponent range), and
its state goes into the checkpoint with epoch, model and optimizer and comes back on
resume. BatchNorm becomes SyncBatchNorm only with nccl on GPUs: on CPU, DDP refuses it
("SyncBatchNorm layers only work with GPU modules"). Each rank's DataLoader has two
worker processes that add random noise to every image; the loader's generator is
seeded per rank and worker_init_fn reseeds the dataset's numpy generator from it, so
no two workers, on any rank, draw the same noise.

Run:  python amp_ddp.py                    (mp.spawn, 2 ranks; no arguments needed)
      python amp_ddp.py --epochs 5         (again: resumes from amp_checkpoint.pt)

Fixed from the source (the DDP + mixed-precision post):
- torch.cuda.amp.autocast inside forward and torch.cuda.amp.GradScaler (deprecated,
  CUDA only) -> torch.autocast(device type) and torch.amp.GradScaler(device type);
- the scaler state was saved but never restored, without epoch or optimizer -> all four,
  written atomically, and loaded on resume;
- convert_sync_batchnorm unconditionally (fails on CPU) -> only with nccl;
- a per-rank generator, but no randomness in the loader for it to seed -> augmentation
  drawn from a numpy generator that worker_init_fn reseeds in every worker;
- test accuracy over a padding DistributedSampler, reduced to rank 0 -> disjoint shards,
  counts summed by all_reduce on every rank; a fixed MASTER_PORT -> a free port.
"""

import argparse
import json
import math
import os
import socket
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

TIMEOUT = timedelta(seconds=60)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class ConvNet(nn.Module):
    """Two conv blocks with BatchNorm and a linear head, for 1 x 8 x 8 images."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 2 * 2, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class NoisyDigits(Dataset):
    """Images with random noise added, drawn from the dataset's own numpy generator."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        self.rng = np.random.default_rng(0)  # every worker gets a copy of this one: see seed_worker

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        noise = self.rng.normal(0.0, 0.1, size=self.images[i].shape).astype(np.float32)
        return self.images[i] + torch.from_numpy(noise), self.labels[i]


def seed_worker(worker_id: int):
    """In each loader worker: reseed the dataset's generator from this worker's own seed.

    The seed is the loader's base seed (drawn from its per-rank generator) + worker_id,
    so it differs between workers and between ranks.
    """
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)


def digits_splits():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return NoisyDigits(images[train], labels[train]), TensorDataset(images[test], labels[test])


def setup(rank: int, world_size: int) -> torch.device:
    """Join the process group (the parent set MASTER_ADDR/PORT); return this rank's device."""
    if torch.cuda.device_count() >= world_size:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
    return device


def log(rank: int, message: str):
    if rank == 0:
        print(message, flush=True)


def evaluate(model: DDP, test_set, rank: int, world_size: int, device, dtype) -> float:
    """Accuracy on the whole test set: unpadded shards, counts summed with all_reduce."""
    for buffer in model.module.buffers():  # plain BatchNorm statistics differ per rank
        dist.broadcast(buffer, src=0)
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)  # correct, seen
    shard = Subset(test_set, range(rank, len(test_set), world_size))
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        for images, labels in DataLoader(shard, batch_size=128):
            predicted = model.module(images.to(device)).argmax(1)
            counts[0] += (predicted == labels.to(device)).sum()
            counts[1] += len(labels)
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def threads_per_rank(local_ranks):
    """OMP_NUM_THREADS where the user set it (torchrun sets 1 for several local workers when
    the user did not), else this rank's share of the CPUs this process may use: its affinity
    (taskset, Slurm), within the cgroup's quota (a container's --cpus)."""
    requested = os.environ.get("OMP_NUM_THREADS", "").strip()
    torchruns = requested == "1" and "TORCHELASTIC_RUN_ID" in os.environ and local_ranks > 1
    if requested.isdigit() and int(requested) > 0 and not torchruns:
        return int(requested)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, max(1, cpus) // max(1, local_ranks))


def worker(rank: int, world_size: int, args):
    torch.set_num_threads(threads_per_rank(world_size))  # mp.spawn sets no limit
    device = setup(rank, world_size)
    dtype = DTYPES[args.dtype]
    train_set, test_set = digits_splits()
    torch.manual_seed(args.seed)
    model = ConvNet()
    if dist.get_backend() == "nccl":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # batch statistics over all ranks
    else:
        log(rank, "SyncBatchNorm skipped: on CPU, DDP accepts it on GPU modules only")
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    start = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])  # the loss scale it had reached, not 65536 again
        start = state["epoch"] + 1
        log(rank, f"resumed after epoch {state['epoch']}, loss scale "
                  f"{scaler.get_scale() if scaler.is_enabled() else 'none (scaler off)'}")
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    # Two loader workers, forked where the system can: a spawned one first imports this
    # whole program again (torch included), which costs seconds.
    context = "fork" if "fork" in mp.get_all_start_methods() else None
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        multiprocessing_context=context, worker_init_fn=seed_worker,
                        generator=torch.Generator().manual_seed(args.seed + rank),
                        pin_memory=device.type == "cuda")
    log(rank, f"{world_size} ranks on {device.type}, autocast {args.dtype}, "
              f"GradScaler {'on' if scaler.is_enabled() else 'off'}")
    epochs = []  # for --report
    for epoch in range(start, args.epochs):
        began = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=dtype):  # forward and loss only
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            scaler.scale(loss).backward()  # multiplied by the loss scale (when enabled)
            scaler.step(optimizer)  # unscales; skips the step if a gradient overflowed
            scaler.update()
        if rank == 0:
            state = {"epoch": epoch, "model": model.module.state_dict(), "dtype": args.dtype,
                     "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
            torch.save(state, args.checkpoint + ".tmp")
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        log(rank, f"epoch {epoch}: last loss {loss.item():.4f}, loss scale "
                  f"{scaler.get_scale() if scaler.is_enabled() else 'none'}, "
                  f"{time.perf_counter() - began:.1f} s")
        epochs.append({"epoch": epoch, "last_loss": loss.item(),
                       "loss_scale": scaler.get_scale() if scaler.is_enabled() else None})
    accuracy = evaluate(model, test_set, rank, world_size, device, dtype)
    log(rank, f"test accuracy {accuracy:.2%}")
    if args.report and rank == 0:  # what it printed, as JSON, written whole (temporary file, renamed)
        with open(f"{args.report}.tmp", "w") as f:
            json.dump({"program": "amp_ddp.py", "checks": [], "world_size": world_size,
                       "device": device.type, "dtype": args.dtype, "scaler": scaler.is_enabled(),
                       "first_epoch": start, "epochs": epochs, "accuracy": accuracy}, f, indent=1)
        os.replace(f"{args.report}.tmp", args.report)
    dist.destroy_process_group()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="Mixed-precision DDP on scikit-learn's digits.")
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD step (default 0.05)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="autocast type (default: float16 on CUDA, bfloat16 on CPU)")
    parser.add_argument("--checkpoint", default="amp_checkpoint.pt", help="saved and resumed from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="also write the epochs and the accuracy here, as JSON")
    args = parser.parse_args()
    for name in ("world_size", "epochs", "batch_size", "lr"):
        if not 0 < getattr(args, name) < math.inf:  # also refuses nan
            parser.error(f"argument --{name.replace('_', '-')}: expected a value > 0, "
                         f"got {getattr(args, name)}")
    if args.dtype == "auto":
        args.dtype = "float16" if torch.cuda.device_count() >= args.world_size else "bfloat16"
    folder = os.path.dirname(os.path.abspath(args.checkpoint))
    if os.path.isdir(args.checkpoint) or not os.access(folder, os.W_OK):
        parser.error(f"argument --checkpoint: cannot write a file at {args.checkpoint!r}")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if os.path.exists(args.checkpoint):
        try:
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        except Exception:
            state = {}
        keys = {"epoch", "model", "optimizer", "scaler", "dtype"}
        if not (isinstance(state, dict) and keys <= state.keys()):
            parser.error(f"argument --checkpoint: {args.checkpoint!r} is not a checkpoint "
                         "of this program (move it away to start afresh)")
        if state["dtype"] != args.dtype:
            parser.error(f"argument --dtype: {args.dtype} differs from the {state['dtype']} "
                         f"that {args.checkpoint!r} was trained with")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
