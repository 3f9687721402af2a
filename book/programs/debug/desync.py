"""Bug: rank 1 skips one collective in the middle of training; the flight recorder shows where.

Every process group records its last collectives (the flight recorder: the
buffer size is TORCH_FR_BUFFER_SIZE). When a collective fails, each rank
writes its record to TORCH_FR_DUMP_TEMP_FILE + rank for comparison.

Run:  TORCH_FR_DUMP_TEMP_FILE=$PWD/fr/rank_ torchrun --standalone --nproc-per-node 2 desync.py
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

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


def dump_flight_record(rank: int) -> str:
    """Write this rank's flight record (a pickle) where TORCH_FR_DUMP_TEMP_FILE says."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", os.path.join("flight_record", "rank_"))
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # A private function of torch 2.14: it returns the record of every group of this process.
    record = torch._C._distributed_c10d._dump_fr_trace()
    with open(f"{prefix}{rank}", "wb") as file:
        file.write(record)
    return f"{prefix}{rank}"


def train_step(step: int, rank: int, device: torch.device) -> None:
    gradient = torch.ones(4, device=device)
    dist.all_reduce(gradient)
    loss = torch.tensor([0.5], device=device)
    # The bug: rank 1 skips logging at step 1 (say, its batch was empty).
    if not (rank == 1 and step == 1):
        dist.all_reduce(loss)


def main() -> None:
    device = start()
    rank = dist.get_rank()
    started = time.monotonic()
    try:
        for step in range(3):
            train_step(step, rank, device)
        dist.barrier()
        # One write per line: torchrun runs python -u, where print() writes the text and the
        # newline separately, and another rank's line can land between the two.
        print(f"[rank {rank}] done\n", end="", flush=True)
    except RuntimeError as error:
        print(f"[rank {rank}] RuntimeError after {time.monotonic() - started:.1f} s: {error}\n",
              end="", flush=True)
        print(f"[rank {rank}] flight record written to {dump_flight_record(rank)}\n",
              end="", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
