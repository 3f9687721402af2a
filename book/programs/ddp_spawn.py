"""DistributedDataParallel started by torch.multiprocessing.spawn: a toy model, then a ConvNet.

Part 1 trains the ToyModel (Linear 10-10, ReLU, Linear 10-5) for a few DDP steps, each
rank on its slice of one batch: the weights equal one process's on the whole batch
(--report saves them). Part 2 trains a ConvNet on MNIST if its files are under --data
(never downloaded), else on scikit-learn's 8x8 digits, with the last layer sized for
8x8 inputs (no upsampling). It shows DistributedSampler + set_epoch, a per-rank seeded
generator, printing on rank 0, an atomic checkpoint (epoch, model, optimizer), resuming
after the saved epoch, and test accuracy counted by every rank and summed by all_reduce.

Run:  python ddp_spawn.py              2 processes: gloo on CPU, nccl with a GPU per rank
      python ddp_spawn.py --epochs 5   again: resumes from checkpoint.pt, runs epochs 3-4

Fixed from the sources (PyTorch's DDP tutorial; the DDP + mixed-precision post):
- a fixed MASTER_PORT (12355, 19198) -> a free port from the operating system;
- `.to(rank)` and "nccl" hard-coded -> backend and device follow the GPUs present;
- no timeout -> a stuck collective raises after 60 s;
- accuracy over a DistributedSampler, which pads by repeating samples -> disjoint,
  unpadded shards whose counts every rank sums with all_reduce;
- a model-only checkpoint written in place -> epoch, model and optimizer, written to a
  temporary file that is renamed over the old one;
- mp.spawn leaves each worker all the cores -> each takes its share of threads;
- the post's advice to call test() on rank 0 only would deadlock: every rank must join
  a collective.
"""

import argparse
import json
import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

TIMEOUT = timedelta(seconds=60)  # a collective that waits longer raises instead of hanging
TOY_STEPS, TOY_ROWS_PER_RANK = 5, 8


class ToyModel(nn.Module):
    """Linear 10-10, ReLU, Linear 10-5: the model of the DDP tutorial."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class ConvNet(nn.Module):
    """Two conv blocks and a linear head for 1 x size x size images (28 for MNIST, 8 for digits)."""

    def __init__(self, size: int, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * (size // 4) ** 2, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def toy_batch(rows: int, seed: int):
    """The same random batch on every rank (inputs, targets)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 10, generator=g), torch.randn(rows, 5, generator=g)


def load_data(root: str):
    """(name, train set, test set, image side): MNIST from local files, else the 8x8 digits."""
    if os.path.isdir(os.path.join(root, "MNIST", "raw")):
        from torchvision import datasets, transforms  # imported only when needed: it is slow

        to_tensor = transforms.ToTensor()
        return ("mnist", datasets.MNIST(root, train=True, transform=to_tensor, download=False),
                datasets.MNIST(root, train=False, transform=to_tensor, download=False), 28)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return ("digits", TensorDataset(images[train], labels[train]),
            TensorDataset(images[test], labels[test]), 8)


def setup(rank: int, world_size: int) -> torch.device:
    """Join the process group (the parent set MASTER_ADDR/PORT); return this rank's device."""
    if torch.cuda.device_count() >= world_size:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
    return device


def cleanup():
    dist.destroy_process_group()


def log(rank: int, message: str):
    if rank == 0:
        print(message, flush=True)


def wrap(model: nn.Module, device: torch.device) -> DDP:
    return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def train_toy(rank: int, world_size: int, device: torch.device, args) -> dict:
    """Part 1: a few DDP steps, each rank on its slice of the batch; returns the final weights."""
    torch.manual_seed(args.seed)  # equal initial weights (DDP would broadcast rank 0's anyway)
    model = wrap(ToyModel(), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = toy_batch(TOY_ROWS_PER_RANK * world_size, args.seed)
    mine = slice(rank * TOY_ROWS_PER_RANK, (rank + 1) * TOY_ROWS_PER_RANK)
    for step in range(TOY_STEPS):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[mine].to(device)), y[mine].to(device))
        loss.backward()  # DDP averages the gradients of all ranks during backward
        optimizer.step()
        log(rank, f"toy step {step}: loss on rank 0's slice {loss.item():.4f}")
    return {name: t.tolist() for name, t in model.module.state_dict().items()}


def save_checkpoint(path: str, epoch: int, model: nn.Module, optimizer):
    """Write a temporary file, then rename it: a crash leaves the old checkpoint or the new one."""
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def evaluate(model: DDP, test_set, rank: int, world_size: int, device, batch_size: int):
    """Accuracy on the whole test set: each rank counts its shard, all_reduce adds the counts."""
    for buffer in model.module.buffers():  # BatchNorm statistics drift apart per rank: use rank 0's
        dist.broadcast(buffer, src=0)
    # rank, rank + world_size, ...: no padding, so no sample is counted twice
    shard = Subset(test_set, range(rank, len(test_set), world_size))
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)  # correct, seen
    with torch.no_grad():  # the plain module: evaluation needs no gradient sync
        for images, labels in DataLoader(shard, batch_size=batch_size):
            predicted = model.module(images.to(device)).argmax(1)
            counts[0] += (predicted == labels.to(device)).sum()
            counts[1] += len(labels)
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item(), counts[1].item()


def train_convnet(rank: int, world_size: int, device: torch.device, args) -> dict:
    """Part 2: the ConvNet with sampler, checkpoint, resume and reduced test accuracy."""
    name, train_set, test_set, size = load_data(args.data)
    log(rank, f"data: {name}, {len(train_set)} training and {len(test_set)} test images")
    torch.manual_seed(args.seed)
    model = ConvNet(size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if os.path.exists(args.checkpoint):  # every rank loads it, onto its own device
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1  # the saved epoch is finished: do not train it again
        log(rank, f"resumed from {args.checkpoint}: epochs 0-{state['epoch']} done")
    model = wrap(model, device)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed)
    # The sampler shuffles; the generator seeds the loader's worker processes (none here,
    # see amp_ddp.py), differently on every rank.
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(args.seed + rank))
    epoch_losses = []
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        model.train()
        loss_sum = torch.zeros((), device=device)
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()  # no .item() per step: it would wait for the GPU
        # For the log, the mean over every rank's batches, not rank 0's alone: every rank
        # calls the all-reduce (outside `if rank == 0`); the sampler gives each as many batches.
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        epoch_losses.append(loss_sum.item() / len(loader))
        if rank == 0:
            save_checkpoint(args.checkpoint, epoch, model.module, optimizer)
        log(rank, f"epoch {epoch}: mean loss {epoch_losses[-1]:.4f} (all ranks), saved {args.checkpoint}")
    accuracy, seen = evaluate(model, test_set, rank, world_size, device, args.batch_size)
    log(rank, f"test accuracy {accuracy:.2%} on {seen} images (all ranks together)")
    return {"dataset": name, "accuracy": accuracy, "test_images": seen,
            "epochs_run": list(range(start, args.epochs)), "epoch_losses": epoch_losses}


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
    # mp.spawn does not set OMP_NUM_THREADS: without this every rank uses every core.
    torch.set_num_threads(threads_per_rank(world_size))
    device = setup(rank, world_size)
    log(rank, f"{world_size} ranks, backend {dist.get_backend()}, device {device.type}")
    toy_weights = train_toy(rank, world_size, device, args)
    result = train_convnet(rank, world_size, device, args)
    if rank == 0 and args.report:  # written whole: a temporary file, renamed
        result.update(checks=[], world_size=world_size, backend=dist.get_backend(),
                      toy={"steps": TOY_STEPS, "lr": args.lr, "seed": args.seed,
                           "weights": toy_weights})
        with open(f"{args.report}.tmp", "w") as f:
            json.dump(result, f)
        os.replace(f"{args.report}.tmp", args.report)
    cleanup()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="DDP with mp.spawn: ToyModel, then a ConvNet with checkpoints.")
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD step (default 0.05)")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="saved and resumed from")
    parser.add_argument("--data", default="data", help="folder with MNIST/raw (default ./data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="rank 0 writes the results here as JSON")
    args = parser.parse_args()
    for name in ("world_size", "epochs", "batch_size", "lr"):
        value = getattr(args, name)
        if not 0 < value < math.inf:  # also refuses nan
            parser.error(f"argument --{name.replace('_', '-')}: expected a value > 0, got {value}")
    for option, path in (("--checkpoint", args.checkpoint), ("--report", args.report)):
        folder = os.path.dirname(os.path.abspath(path or "."))
        if path and (os.path.isdir(path) or not os.access(folder, os.W_OK)):
            parser.error(f"argument {option}: cannot write a file at {path!r}")
    if os.path.exists(args.checkpoint):
        try:
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        except Exception:
            state = None
        if not (isinstance(state, dict) and {"epoch", "model", "optimizer"} <= state.keys()):
            parser.error(f"argument --checkpoint: {args.checkpoint!r} is not a checkpoint "
                         "of this program (move it away to start afresh)")
    return args


def free_port() -> int:
    """A port nobody listens on right now, chosen by the operating system."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # every rank runs on this machine
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
