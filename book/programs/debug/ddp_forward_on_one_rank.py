"""Bug: only rank 0 runs a forward and backward pass of the DDP model (say, a quick extra
validation step with gradients). Its backward waits for a gradient all-reduce no one joins.

Run:  torchrun --standalone --nproc-per-node 2 ddp_forward_on_one_rank.py
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn
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


def main() -> None:
    device = start()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1).to(device))
    started = time.monotonic()
    try:
        if rank == 0:  # the bug
            loss = model(torch.randn(16, 8, device=device)).pow(2).mean()
            # One write per line: torchrun runs python -u, where print() writes the text and the
            # newline separately, and another rank's line can land between the two.
            print(f"[rank {rank}] forward done, starting backward\n", end="", flush=True)
            loss.backward()  # DDP's hooks all-reduce the gradients here
            print(f"[rank {rank}] backward done\n", end="", flush=True)
        print(f"[rank {rank}] waiting at the barrier\n", end="", flush=True)
        dist.barrier()
        print(f"[rank {rank}] done\n", end="", flush=True)
    except RuntimeError as error:
        print(f"[rank {rank}] RuntimeError after {time.monotonic() - started:.1f} s: {error}\n",
              end="", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
