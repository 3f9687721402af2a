"""Bug: the ranks have different numbers of batches. The rank with fewer finishes first and waits
at the barrier, while the other waits in its next gradient all-reduce.

Run:  torchrun --standalone --nproc-per-node 2 ddp_uneven_inputs.py
Fix:  ... ddp_uneven_inputs.py --join    (Join shadows the all-reduces of the ranks that are done)
"""

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = datetime.timedelta(seconds=5)  # short on purpose; the default is 30 min (gloo), 10 (nccl)
JOIN_TIMEOUT = datetime.timedelta(seconds=120)


def start() -> torch.device:
    """Join torchrun's group on gloo and the CPU, on every machine, GPUs or not.

    What this program shows is gloo's behaviour: a collective that its peers do not join
    raises a RuntimeError on the waiting rank after TIMEOUT. With nccl under torchrun the
    watchdog aborts the process instead (chapter 10, "On real GPUs").
    """
    # Every rank imports torch before it joins, which can take longer than TIMEOUT on a busy
    # machine: the group is joined with a generous timeout, then the short one is set.
    dist.init_process_group("gloo", timeout=JOIN_TIMEOUT)
    dist.set_timeout(TIMEOUT)
    return torch.device("cpu")


def train(model: DDP, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], rank: int) -> None:
    for x in batches:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # One write per line: torchrun runs python -u, where print() writes the text and the
    # newline separately, and another rank's line can land between the two.
    print(f"[rank {rank}] trained on all {len(batches)} of my batches\n", end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--join", action="store_true")
    args = parser.parse_args()
    device = start()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # The bug: rank 0 has 3 batches, rank 1 has 5 (an unevenly split dataset, no DistributedSampler).
    batches = [torch.randn(16, 8, device=device) for _ in range(3 + 2 * rank)]
    started = time.monotonic()
    try:
        if args.join:
            with Join([model]):
                train(model, optimizer, batches, rank)
        else:
            train(model, optimizer, batches, rank)
        dist.barrier()  # e.g. before rank 0 saves a checkpoint
        print(f"[rank {rank}] done after {time.monotonic() - started:.1f} s\n", end="", flush=True)
    except RuntimeError as error:
        print(f"[rank {rank}] RuntimeError after {time.monotonic() - started:.1f} s: {error}\n",
              end="", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
