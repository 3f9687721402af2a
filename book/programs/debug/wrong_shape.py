"""Bug: two ranks all-reduce tensors of different shapes.

Run:  torchrun --standalone --nproc-per-node 2 wrong_shape.py
Then: TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 wrong_shape.py
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
    device = start()
    rank = dist.get_rank()
    # The bug: rank 1 builds its tensor from a different config (3 features instead of 4).
    features = 4 if rank == 0 else 3
    gradient = torch.ones(features, device=device)
    started = time.monotonic()
    try:
        dist.all_reduce(gradient)
        # One write per line: torchrun runs python -u, where print() writes the text and the
        # newline separately, and another rank's line can land between the two.
        print(f"[rank {rank}] all_reduce returned {gradient.tolist()}\n", end="", flush=True)
        # The rest of the step (optimizer, next batch): the sleep stands for it. Rank 1 reaches
        # the barrier a whole timeout after rank 0 began to wait, so rank 0's timeout comes first.
        time.sleep(TIMEOUT.total_seconds())
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
