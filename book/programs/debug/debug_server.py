"""Bug: every rank waits to receive and nobody sends. This time the job itself serves its
stacks and flight records over HTTP: torch.distributed.debug's debug server.

Run:  torchrun --standalone --nproc-per-node 2 debug_server.py
Then: curl http://localhost:25999/stacks          (every rank's Python stack)
      curl http://localhost:25999/fr_trace_json   (every rank's flight record)

Source: torch.distributed.debug.start_debug_server (torch 2.14.1, marked experimental): rank 0
serves the pages and fetches each page's data from every rank's own small server.
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.debug import start_debug_server, stop_debug_server

TIMEOUT = datetime.timedelta(seconds=30)  # long enough to look, short enough to end
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
    rank, world = dist.get_rank(), dist.get_world_size()
    # On every rank (each starts its own worker server; rank 0 also the pages). It reads
    # MASTER_ADDR and MASTER_PORT to find the others, as init_process_group does.
    start_debug_server(port=int(os.environ.get("DEBUG_SERVER_PORT", "25999")))
    dist.all_reduce(torch.ones(4, device=device))  # one collective that completes
    print(f"[rank {rank}] waiting to receive from rank {(rank - 1) % world}\n", end="", flush=True)
    try:
        dist.recv(torch.zeros(1, device=device), src=(rank - 1) % world)  # nobody sends
    finally:
        stop_debug_server()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
