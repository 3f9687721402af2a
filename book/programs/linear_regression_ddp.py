"""Linear regression with DDP: learn y = 2 x1 + 3 x2, and see what gradient averaging does.

nn.Linear(2, 1, bias=False), starting from w = [0, 0], fits 32 exact samples of
y = 2 x1 + 3 x2; every rank trains on its own equal share. After each backward pass DDP
holds the AVERAGE of the ranks' gradients.
- With a mean loss (--loss mean, the default) that average is exactly the gradient of
  the mean loss over the whole batch: DDP steps like one process on all the data.
- With a sum loss (--loss sum, as the source uses), each rank's gradient is that of a
  sum over its share only, and the average is 1 / world_size of the gradient of the sum
  over all the data: with the same learning rate, DDP's step is 1 / world_size of one
  process's step. The effective learning rate is lr / world_size.
Rank 0 also trains one process on the whole batch with the same loss and learning rate,
prints both trajectories and the ratio of their first steps, which is that factor.

Run:  python linear_regression_ddp.py               (2 ranks via mp.spawn, mean loss)
      python linear_regression_ddp.py --loss sum

Fixed from the source (the OneFlow book's DDP example): two pairs of samples split by
hand -> 32 samples shared equally by any number of ranks; a sum loss that, under
PyTorch's DDP, steps with half the learning rate it sets, without a word about it ->
the factor is measured against one process. A sum loss's gradient grows with the
batch, so each loss has its own default learning rate.
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
from torch.nn.parallel import DistributedDataParallel as DDP

SAMPLES = 32
DEFAULT_LR = {"mean": 0.1, "sum": 0.005}
SHOWN_STEPS = (1, 2, 3, 10, 50, 100)


def make_data():
    """32 inputs and their exact targets y = 2 x1 + 3 x2 (the same on every rank)."""
    x = torch.randn(SAMPLES, 2, generator=torch.Generator().manual_seed(0))
    return x, x @ torch.tensor([[2.0], [3.0]])


def fit(model: nn.Module, x, y, loss: str, lr: float, steps: int) -> list[list[float]]:
    """Plain SGD; returns w before the first step and after every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    weights = model.module.weight if isinstance(model, DDP) else model.weight
    trajectory = [weights.flatten().tolist()]
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x), y, reduction=loss).backward()  # DDP: gradients averaged here
        optimizer.step()
        trajectory.append(weights.flatten().tolist())
    return trajectory


def linear_model() -> nn.Linear:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)  # w = [0, 0], as in the source
    return model


def worker(rank: int, world_size: int, args):
    torch.set_num_threads(1)  # a 2x1 matrix product gains nothing from threads
    if torch.cuda.device_count() >= world_size:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    x, y = (t.to(device) for t in make_data())
    mine = slice(rank * SAMPLES // world_size, (rank + 1) * SAMPLES // world_size)
    model = linear_model().to(device)
    ddp = fit(DDP(model, device_ids=[device.index] if device.type == "cuda" else None),
              x[mine], y[mine], args.loss, args.lr, args.steps)
    if rank == 0:  # one process on the whole batch, for comparison
        one = fit(linear_model().to(device), x, y, args.loss, args.lr, args.steps)
        print(f"loss={args.loss}, lr={args.lr:g}, {world_size} ranks x "
              f"{SAMPLES // world_size} samples; one process: {SAMPLES} samples, same lr")
        print(f"{'step':>5}  {'DDP w':>20}  {'one process w':>20}")
        for step in [s for s in SHOWN_STEPS if s < args.steps] + [args.steps]:
            print(f"{step:>5}  {fmt(ddp[step]):>20}  {fmt(one[step]):>20}")
        ratio = [(d - w) / (o - w) for d, o, w in zip(ddp[1], one[1], ddp[0], strict=True)]
        print(f"first step, DDP / one process: {fmt(ratio, 6)} -> effective learning rate "
              f"{args.lr * ratio[0]:g} (lr {args.lr:g})")
        if args.report:  # written whole: a temporary file, renamed
            with open(f"{args.report}.tmp", "w") as f:
                json.dump({"checks": [], "loss": args.loss, "lr": args.lr, "world_size": world_size,
                           "ddp": ddp, "one_process": one}, f)
            os.replace(f"{args.report}.tmp", args.report)
    dist.destroy_process_group()


def fmt(values: list[float], digits: int = 4) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="DDP linear regression: mean vs sum loss.")
    parser.add_argument("--loss", choices=["mean", "sum"], default="mean")
    parser.add_argument("--lr", type=float, help="SGD step (default 0.1 for mean, 0.005 for sum)")
    parser.add_argument("--steps", type=int, default=100, help="SGD steps (default 100)")
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--report", help="rank 0 writes both trajectories here as JSON")
    args = parser.parse_args()
    if args.lr is not None and not 0 < args.lr < math.inf:
        parser.error(f"argument --lr: expected a value > 0, got {args.lr}")
    args.lr = DEFAULT_LR[args.loss] if args.lr is None else args.lr
    if args.steps < 1:
        parser.error(f"argument --steps: expected a value >= 1, got {args.steps}")
    if args.world_size < 1 or SAMPLES % args.world_size:
        parser.error(f"argument --world-size: expected a divisor of {SAMPLES} "
                     f"(the samples are shared equally), got {args.world_size}")
    folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.report and (os.path.isdir(args.report) or not os.access(folder, os.W_OK)):
        parser.error(f"argument --report: cannot write a file at {args.report!r}")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
