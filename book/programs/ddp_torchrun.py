"""DistributedDataParallel started by torchrun: the same program as ddp_spawn.py.

torchrun starts one process per rank and sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; init_process_group reads them
("env://"). Only the start-up differs from ddp_spawn.py: compare the two files.
Part 1 trains the ToyModel for a few DDP steps (equal to one process on the whole
batch); part 2 a ConvNet on MNIST under --data or on scikit-learn's 8x8 digits, with
DistributedSampler + set_epoch, an atomic checkpoint, resuming after the saved epoch,
and test accuracy counted by every rank and summed by all_reduce.

Run:  torchrun --standalone --nproc-per-node=2 ddp_torchrun.py
      torchrun --standalone --nproc-per-node=2 ddp_torchrun.py --epochs 5   (resumes)
      torchrun --standalone --nproc-per-node=2 ddp_torchrun.py --crash-rank 1
          (rank 1 raises before training: @record writes its traceback to the error file
           torchrun names in TORCHELASTIC_ERROR_FILE, and the agent reports it)

Fixed from the source (the DDP + mixed-precision post, torchrun variant):
- "nccl" hard-coded -> gloo on CPU unless this machine has a GPU for every local rank;
- the GPU of a process is its LOCAL_RANK (its rank on this machine), not its RANK;
- no timeout -> a stuck collective raises after 60 s;
- padded test shards counted twice, a model-only checkpoint written in place: fixed
  as in ddp_spawn.py;
- the post's advice to call test() on rank 0 only would deadlock: every rank must join
  a collective.
"""

import argparse
import json
import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

TIMEOUT = timedelta(seconds=60)  # a collective that waits longer raises instead of hanging
TOY_STEPS, TOY_ROWS_PER_RANK = 5, 8
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DeliberateCrash(RuntimeError):
    """Raised by --crash-rank: a worker that fails on purpose, to read its error file."""


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


def setup() -> torch.device:
    """Join the process group (torchrun set the variables it reads); return this rank's device."""
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", timeout=TIMEOUT)
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
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(threads_per_rank(local_world_size))  # the same rule as ddp_spawn.py
    device = setup()
    log(rank, f"{world_size} ranks, backend {dist.get_backend()}, device {device.type}")
    if rank == args.crash_rank:  # the others then fail in their next collective
        raise DeliberateCrash(f"rank {rank} crashed on purpose before training (--crash-rank)")
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
    parser = Parser(description="DDP with torchrun: ToyModel, then a ConvNet with checkpoints.")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD step (default 0.05)")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="saved and resumed from")
    parser.add_argument("--data", default="data", help="folder with MNIST/raw (default ./data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="rank 0 writes the results here as JSON")
    parser.add_argument("--crash-rank", type=int, default=-1,
                        help="this rank raises before training (to see the error files)")
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "lr"):
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
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        parser.error(f"{missing[0]} is not set: start me with "
                     f"torchrun --standalone --nproc-per-node=2 {parser.prog}")
    return args


@record  # an exception escaping main() is written, with its traceback, to the error file
def main():
    args = parse_args()
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
