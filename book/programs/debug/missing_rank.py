"""Bug: one rank never arrives (stuck in its data loading); monitored_barrier names it.

Run:  torchrun --standalone --nproc-per-node 2 missing_rank.py
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=5)  # short on purpose; the default is 30 min (gloo), 10 (nccl)


def start() -> torch.device:
    """Join torchrun's group: one GPU per rank when there are enough, else the CPU."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=TIMEOUT)
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    return torch.device("cpu")


def main() -> None:
    start()
    rank = dist.get_rank()
    # monitored_barrier runs on gloo only: with nccl, give it a gloo group of the same ranks.
    checkpoint_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    if rank == 1:
        # One write per line: torchrun runs python -u, where print() writes the text and the
        # newline separately, and another rank's line can land between the two.
        print(f"[rank {rank}] loading a shard that never comes...\n", end="", flush=True)
        time.sleep(60)  # the bug: stuck (torchrun stops this rank once rank 0 has failed)
    started = time.monotonic()
    try:
        dist.monitored_barrier(group=checkpoint_group, timeout=datetime.timedelta(seconds=3),
                               wait_all_ranks=True)
        print(f"[rank {rank}] every rank arrived\n", end="", flush=True)
    except RuntimeError as error:
        print(f"[rank {rank}] RuntimeError after {time.monotonic() - started:.1f} s: {error}\n",
              end="", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
