"""Bug: every rank waits for another (each receives before it sends). Nothing fails, nothing moves.

Run:  torchrun --standalone --nproc-per-node 2 deadlock.py
and, while it hangs, from another terminal:  py-spy dump --pid PID  (PIDs printed below)
"""

import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)  # long enough to look at the hang; then it fails
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


def exchange(rank: int, world: int, device: torch.device) -> torch.Tensor:
    """Pass a value around the ring: the bug is the order (receive first, then send)."""
    received = torch.zeros(1, device=device)
    dist.recv(received, src=(rank - 1) % world)
    dist.send(torch.tensor([float(rank)], device=device), dst=(rank + 1) % world)
    return received


def main() -> None:
    device = start()
    rank, world = dist.get_rank(), dist.get_world_size()
    # One write per line: torchrun runs python -u, where print() writes the text and the
    # newline separately, and another rank's line can land between the two.
    print(f"[rank {rank}] pid {os.getpid()}: exchanging with my neighbours\n", end="", flush=True)
    try:
        exchange(rank, world, device)
        print(f"[rank {rank}] done\n", end="", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
