r"""Elastic training under torchrun: a restart with a new world size resumes from a checkpoint.

When a node joins or leaves, torchrun stops every worker and starts a new group with
a new WORLD_SIZE. Nothing in memory survives, so the program keeps its progress in a
checkpoint: rank 0 saves {epoch, model, optimizer} after every epoch (a temporary
file renamed over the old one), and at start-up every rank loads it, if present, and
goes on with the next epoch. The data is a fixed synthetic set that DistributedSampler
shares out anew for every world size. Each epoch prints one line with WORLD_SIZE and
TORCHELASTIC_RESTART_COUNT (it counts failures only: a node joining restarts the
workers without counting). --epoch-log appends one JSON line per finished epoch.
main() is wrapped in @record: a worker's exception is written, with its traceback, to
the error file torchrun names in TORCHELASTIC_ERROR_FILE, and the agent reports it.

Run on one machine:
  torchrun --standalone --nproc-per-node=2 elastic_train.py
Elastic: start this in two terminals, the second while the first trains:
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=1 \
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job1 \
  --rdzv-conf=join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3 \
  --monitor-interval=0.5 --max-restarts=3 elastic_train.py --epochs 40 --epoch-seconds 0.5
(Without the variable, an agent that joins a running job waits for a store address
that is never published, and the scale-up hangs. The rdzv-conf values and the monitor
interval bring the first start and the recovery from a lost node down from tens of
seconds to a few.)
--timeout bounds every collective after the group has formed: a node that vanishes
without closing its connections (a link down, a machine frozen) is noticed only when
it runs out, so it sets how long the others wait before they restart without it.

Fixed from the source (the Zhihu article "elastic training, minimal implementation"):
- it resumed at the saved epoch, training that epoch twice -> saved epoch + 1;
- optimizer.zero_grad() ran once, before the loop: gradients piled up over epochs;
- every rank wrote checkpoint.pt in place at once -> rank 0 writes a temporary file and
  renames it, with torchrun's stop signal held back so the save and its log line
  happen together or not at all;
- torch.load without map_location or weights_only -> both;
- new random data every step (nothing to learn) -> one fixed set, sharded by rank;
- "nccl" and .cuda(local_rank) hard-coded, no timeout -> chosen by availability, 60 s
  to form the group, then --timeout (60 s by default) for every collective.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TIMEOUT = timedelta(seconds=60)
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ToyModel(nn.Module):
    """Linear 10-10, ReLU, Linear 10-5: the model of the source article."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def make_dataset(samples: int = 256, seed: int = 0) -> TensorDataset:
    """Inputs and noisy targets of a fixed random linear map: the same on every rank and run."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 10, generator=g)
    y = x @ torch.randn(10, 5, generator=g) + 0.1 * torch.randn(samples, 5, generator=g)
    return TensorDataset(x, y)


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


def setup(timeout: float) -> torch.device:
    """Join the group torchrun describes in the environment; return this worker's device."""
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", timeout=TIMEOUT)
    dist.set_timeout(timedelta(seconds=timeout))  # every collective from here on
    return device


@contextlib.contextmanager
def sigterm_held_back():
    """Delay SIGTERM, which torchrun sends to stop its workers, until the block is done."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            signal.raise_signal(signal.SIGTERM)  # now act on it as before


def commit(args, epoch: int, model: nn.Module, optimizer, log_entry: dict):
    """Rank 0's end of epoch: the checkpoint (atomic), then the epoch's log line."""
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with sigterm_held_back():
        torch.save(state, args.checkpoint + ".tmp")
        os.replace(args.checkpoint + ".tmp", args.checkpoint)
        if args.epoch_log:
            with open(args.epoch_log, "a") as f:
                f.write(json.dumps(log_entry) + "\n")


def train(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    device = setup(args.timeout)
    torch.manual_seed(args.seed)
    model = ToyModel().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = 0
    if os.path.exists(args.checkpoint):  # every rank loads it, onto its own device
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1  # the saved epoch is complete
    if rank == 0:
        print(f"world size {world_size}, restart count {restarts}: "
              f"{f'resuming at epoch {start}' if start else 'starting at epoch 0'}", flush=True)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    dataset = make_dataset(seed=args.seed)
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        total, seen = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()  # every step: the source did this once, before the loop
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(x), seen + len(x)
        time.sleep(args.epoch_seconds)  # slow enough for a node to join mid-run
        if rank == 0:
            log_entry = {"epoch": epoch, "world_size": world_size, "restart_count": restarts,
                         "loss": total / seen}
            commit(args, epoch, model.module, optimizer, log_entry)
            print(f"epoch {epoch}: world size {world_size}, restart count {restarts}, "
                  f"rank 0 loss {total / seen:.4f}", flush=True)
    dist.destroy_process_group()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="Elastic DDP training of the ToyModel under torchrun.")
    parser.add_argument("--epochs", type=int, default=20, help="total epochs (default 20)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD step (default 0.05)")
    parser.add_argument("--epoch-seconds", type=float, default=0.0,
                        help="sleep this long after each epoch (default 0)")
    parser.add_argument("--checkpoint", default="checkpoint.pt", help="shared by all restarts")
    parser.add_argument("--epoch-log", help="append one JSON line per finished epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a collective waits for the other ranks (default 60)")
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "lr", "timeout"):
        if not 0 < getattr(args, name) < math.inf:  # also refuses nan
            parser.error(f"argument --{name.replace('_', '-')}: expected a value > 0, "
                         f"got {getattr(args, name)}")
    if not 0 <= args.epoch_seconds < math.inf:
        parser.error(f"argument --epoch-seconds: expected a value >= 0, got {args.epoch_seconds}")
    for option, path in (("--checkpoint", args.checkpoint), ("--epoch-log", args.epoch_log)):
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
    train(parse_args())


if __name__ == "__main__":
    main()
