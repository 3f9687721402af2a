"""All-reduce by hand: a ring of point-to-point messages, checked against dist.all_reduce.

All-reduce leaves on every rank the element-wise sum of every rank's tensor. The ring
version cuts the tensor into world_size chunks and only ever talks to its neighbours:

  reduce-scatter, world_size - 1 steps: in step s, rank r sends chunk (r - s) to rank
    r + 1, receives chunk (r - s - 1) from rank r - 1 and adds it to its own copy.
    Afterwards rank r holds the complete sum of chunk (r + 1).
  all-gather, world_size - 1 steps: in step s, rank r sends its complete chunk
    (r + 1 - s) to the right and receives the complete chunk (r - s) from the left.

(Chunk and rank numbers are modulo world_size.) Each rank sends 2 (W - 1) / W of the
tensor in all: almost the same for 2 ranks as for 2000. Each exchange posts its send
and its receive together (batch_isend_irecv) before waiting for either; with a blocking
send first, every rank could wait in send for a neighbour that is itself waiting in
send (under nccl even a separate isend and irecv can, so the two go in one batch). The
program sums one random tensor per rank both ways, prints the largest difference over
all ranks (the sums add in a different order, so the last bits may differ) and the
time of each.

Run:  python ring_allreduce.py                          (3 ranks, mp.spawn)
      python ring_allreduce.py --world-size 4 --numel 10

Source: the hand-written all-reduce that the Zhihu series of the elastic article
announces; its code is not among the book's sources, so this one is written afresh.
"""

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=60)


def exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int):
    """Send to the right neighbour and receive from the left one at the same time."""
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right),
                                       dist.P2POp(dist.irecv, recv, left)])
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` (contiguous) over all ranks, in place, and return it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views: writing a chunk writes the tensor
    incoming = torch.empty_like(chunks[0])  # the first chunk is the largest
    for step in range(world - 1):  # reduce-scatter
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        exchange(send, incoming[:recv.numel()], right, left)
        recv += incoming[:recv.numel()]
    for step in range(world - 1):  # all-gather: complete chunks overwrite partial ones
        send, recv = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        exchange(send, recv, right, left)
    return tensor


def median_ms(fn, data: torch.Tensor, repeats: int) -> float:
    """Median wall time of ``fn`` on fresh copies of ``data``, every rank starting together."""
    times = []
    for _ in range(repeats):
        copy = data.clone()
        dist.barrier()
        began = time.perf_counter()
        fn(copy)
        if copy.is_cuda:
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def threads_per_rank(local_ranks):
    """OMP_NUM_THREADS where the user set it (torchrun sets 1 for several local workers when
    the user did not), else this rank's share of the CPUs this process may use: its affinity
    (taskset, Slurm), within the cgroup's quota (a container's --cpus)."""
    requested = os.environ.get("OMP_NUM_THREADS", "").strip()
    torchruns = requested == "1" and "TORCHELASTIC_RUN_ID" in os.environ and local_ranks > 1
    if requested.isdigit() and int(requested) > 0 and not torchruns:
        return int(requested)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, max(1, cpus) // max(1, local_ranks))


def worker(rank: int, world_size: int, args):
    torch.set_num_threads(threads_per_rank(world_size))  # mp.spawn sets no limit
    if torch.cuda.device_count() >= world_size:
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
    data = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank)).to(device)
    by_hand = ring_all_reduce(data.clone())
    library = data.clone()
    dist.all_reduce(library)
    difference = (by_hand - library).abs().max()
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)  # the worst rank
    ring_ms = median_ms(ring_all_reduce, data, args.repeats)
    library_ms = median_ms(dist.all_reduce, data, args.repeats)
    if rank == 0:
        print(f"{world_size} ranks ({backend}), {args.numel} float32 values each")
        print(f"max |ring - dist.all_reduce| = {difference.item():.3g} (all ranks)")
        print(f"median time: ring {ring_ms:.2f} ms, dist.all_reduce {library_ms:.2f} ms")
        if args.report:  # what it printed, as JSON, written whole (a temporary file, renamed)
            with open(f"{args.report}.tmp", "w") as f:
                json.dump({"program": "ring_allreduce.py", "checks": [], "world_size": world_size,
                           "backend": backend, "numel": args.numel, "max_difference": difference.item(),
                           "ring_ms": ring_ms, "all_reduce_ms": library_ms}, f, indent=1)
            os.replace(f"{args.report}.tmp", args.report)
    dist.destroy_process_group()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args():
    parser = Parser(description="A ring all-reduce with isend/irecv, checked against all_reduce.")
    parser.add_argument("--world-size", type=int, default=3, help="processes (default 3)")
    parser.add_argument("--numel", type=int, default=1_000_003,
                        help="values per rank (default 1000003: chunks of unequal size)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--report", help="also write the difference and the times here, as JSON")
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error(f"argument --world-size: a ring needs at least 2 ranks, "
                     f"got {args.world_size}")
    if args.numel < args.world_size:
        parser.error(f"argument --numel: expected at least one value per rank "
                     f"({args.world_size}), got {args.numel}")
    if args.repeats < 1:
        parser.error(f"argument --repeats: expected a value >= 1, got {args.repeats}")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    args = parse_args()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
