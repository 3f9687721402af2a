"""What a collective does when the link between nodes goes dead (run with one rank per node).

Run on each node K of 2:
  GLOO_SOCKET_IFNAME=IF torchrun --nnodes 2 --nproc-per-node 1 --node-rank K \\
      --rdzv-endpoint NODE0_ADDR:29500 dead_link.py --timeout 10

Every rank all-reduces 64 KiB in a loop and prints each step; pull the cable of a node
(ip link set IF down) while it runs. A dead link sends no reset: gloo's receive waits
for bytes that never come, until the process group's timeout, and then raises. The
program prints how long after the last good step that was, and the error's last line.
With --report FILE every rank (one per node) writes them to FILE on its node, as JSON.
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser(description="a collective on a dead link")
    p.add_argument("--timeout", type=float, default=10.0, help="the process group's, in seconds")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--progress", help="rank 0 writes the number of steps done here")
    p.add_argument("--report", help="this rank writes its steps and its error here, as JSON")
    args = p.parse_args()
    folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.report and not os.path.isdir(folder):
        p.exit(2, f"{p.prog}: error: argument --report: no folder {folder}\n")  # one line, no group
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    x = torch.ones(2**14)
    last = time.monotonic()
    done = 0
    try:
        for step in range(args.steps):
            dist.all_reduce(x)
            x.fill_(1.0)
            last, done = time.monotonic(), step + 1
            print(f"rank {rank}: step {step} done", flush=True)
            if args.progress and rank == 0:
                with open(args.progress, "w") as f:
                    f.write(str(step + 1))
            time.sleep(0.1)
    except RuntimeError as exc:
        reason, waited = str(exc).strip().splitlines()[-1], time.monotonic() - last
        print(f"rank {rank}: all_reduce raised {waited:.1f} s after the last "
              f"good step: {reason}", flush=True)
        if args.report:
            write_report(args.report, {"checks": [], "rank": rank, "steps": done,
                                       "error": reason, "raised_after_s": waited})
        os._exit(1)  # the group is broken: leave without destroying it
    if args.report:
        write_report(args.report, {"checks": [], "rank": rank, "steps": done, "error": None,
                                   "raised_after_s": None})
    dist.destroy_process_group()


def write_report(path, report):
    """The report, written whole: a temporary file, then renamed (a file that exists is complete)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    main()
