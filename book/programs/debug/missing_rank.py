"""Bug: one rank never arrives (stuck in its data loading); monitored_barrier names it.

Run:  torchrun --standalone --nproc-per-node 2 missing_rank.py
"""

import datetime
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


def main() -> None:
    start()
    rank = dist.get_rank()
    # monitored_barrier needs a group with a CPU backend: gloo here; an nccl-only job gives it
    # a gloo group of the same ranks (or starts with init_process_group("cpu:gloo,cuda:nccl")).
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
