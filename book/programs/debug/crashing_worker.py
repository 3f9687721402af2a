"""A worker that crashes, decorated with @record so its traceback reaches torchrun's summary.

Run:  torchrun --standalone --nproc-per-node 2 --log-dir logs --redirects 3 --tee 1 \
          --local-ranks-filter 1 crashing_worker.py
"""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

TIMEOUT = datetime.timedelta(seconds=10)
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


def load_batch(rank: int, index: int) -> torch.Tensor:
    if rank == 1 and index == 3:
        raise ValueError(f"batch {index} of rank {rank} has no labels")  # the crash
    return torch.ones(4)


@record  # writes the exception to the file torchrun names in TORCHELASTIC_ERROR_FILE
def main() -> None:
    device = start()
    rank = dist.get_rank()
    # One write per line: torchrun runs python -u, where print() writes the text and the
    # newline separately, and another rank's line can land between the two.
    print(f"[rank {rank}] started (this goes to stdout)\n", end="", flush=True)
    print(f"[rank {rank}] a warning (this goes to stderr)\n", end="", file=sys.stderr, flush=True)
    for index in range(5):
        batch = load_batch(rank, index).to(device)
        dist.all_reduce(batch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
