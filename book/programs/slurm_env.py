"""What Slurm tells each task against what torchrun tells each rank, gathered and compared.

Run on a Slurm allocation, one torchrun agent per node (``srun`` starts the agents):

    srun --nodes=2 --ntasks-per-node=1 bash -c 'exec torchrun --nnodes=2 --nproc-per-node=2 \
        --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=$SLURM_JOB_ID \
        slurm_env.py --report env.json'

Run it so, not by hand: it needs both Slurm's variables and torchrun's.
Source: written for this book, no article behind it; the device choice is ddp_torchrun.py's.

Slurm numbers tasks: ``SLURM_PROCID`` (0 .. ``SLURM_NTASKS``-1), ``SLURM_NODEID``
(the node's index in the allocation), ``SLURM_LOCALID`` (the task on its node).
Here a task is a torchrun agent, not a rank: torchrun gives each of its workers
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
(its agent's node rank, numbered by the c10d rendezvous in the order the agents
joined, not by Slurm). Every worker inherits its agent's ``SLURM_*`` variables,
so two workers of one node see the same ``SLURM_PROCID``.

``--report FILE`` (rank 0): ``checks``; ``ranks``: each rank's variables, by rank;
``node_rank_is_slurm_nodeid``: whether the rendezvous happened to number the nodes
as Slurm did (nothing guarantees it).
"""

import argparse
import json
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

SLURM = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURM_NTASKS",
         "SLURM_NNODES", "SLURMD_NODENAME", "SLURM_JOB_NODELIST")
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")


def rank_device() -> torch.device:
    """This rank's GPU, or the CPU where ranks would have to share one (nccl refuses that).

    GPU LOCAL_RANK when this machine shows one per local rank; cuda:0 when the launcher
    left this rank exactly one (CUDA_VISIBLE_DEVICES names one device: srun --gpus-per-task=1,
    torchrun --virtual-local-rank). A torchrun worker other than local rank 0 that sees one
    listed GPU shares it (torchrun passes its CUDA_VISIBLE_DEVICES to every worker
    unchanged): refused in one line, since rank 0 takes that GPU with nccl.
    """
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if gpus == 1 and len(visible) == 1:
        if local_rank > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            print(f"{gpus} GPU visible to every one of {local_ranks} local ranks: nccl needs a GPU "
                  "of its own for each rank (run one rank per GPU, give each its own with torchrun "
                  "--virtual-local-rank, or hide it with CUDA_VISIBLE_DEVICES= to run on the CPU)",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def checks_of(rows):
    """The relations between the two numberings that hold on every allocation."""
    world = int(rows[0]["WORLD_SIZE"])
    local = int(rows[0]["LOCAL_WORLD_SIZE"])
    by_node = {}
    for row in rows:
        by_node.setdefault(row["SLURM_NODEID"], set()).add(row["GROUP_RANK"])
    return [
        {"name": "the ranks are 0 .. WORLD_SIZE-1, once each",
         "ok": sorted(int(r["RANK"]) for r in rows) == list(range(world))},
        {"name": "WORLD_SIZE = SLURM_NTASKS x LOCAL_WORLD_SIZE (a task is an agent)",
         "ok": all(int(r["WORLD_SIZE"]) == int(r["SLURM_NTASKS"]) * local for r in rows)},
        {"name": "RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK",
         "ok": all(int(r["RANK"]) == int(r["GROUP_RANK"]) * local + int(r["LOCAL_RANK"]) for r in rows)},
        {"name": "the workers of one Slurm node share one torchrun node rank",
         "ok": all(len(ranks) == 1 for ranks in by_node.values())
         and len({next(iter(v)) for v in by_node.values()}) == len(by_node)},
        {"name": "each worker runs on the node Slurm named (host name = SLURMD_NODENAME)",
         "ok": all(r["hostname"] == r["SLURMD_NODENAME"] for r in rows)},
        {"name": "the rendezvous id is the job id",
         "ok": all(r["TORCHELASTIC_RUN_ID"] == r["SLURM_JOB_ID"] for r in rows)},
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--report", help="rank 0 writes the variables and checks here (JSON)")
    args = parser.parse_args()
    missing = [name for name in (*SLURM, *TORCHRUN) if name not in os.environ]
    if missing:
        parser.exit(2, f"{parser.prog}: error: {missing[0]} is not set: run me with srun + torchrun\n")
    device = rank_device()  # all_gather_object sends its bytes from the rank's device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=60))
    mine = {name: os.environ[name] for name in (*SLURM, *TORCHRUN)}
    mine["hostname"] = socket.gethostname()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        rows.sort(key=lambda r: int(r["RANK"]))
        checks = checks_of(rows)
        for check in checks:
            print(f"check: {check['name']}: {'OK' if check['ok'] else 'FAILED'}", flush=True)
        report = {"checks": checks, "ranks": rows,
                  "node_rank_is_slurm_nodeid": all(r["GROUP_RANK"] == r["SLURM_NODEID"] for r in rows)}
        if args.report:
            with open(args.report + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(args.report + ".tmp", args.report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
