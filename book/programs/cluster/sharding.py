"""FSDP2 across two nodes, and HSDP (shard inside a node, replicate across): bytes on the link.

Run on each node K of 2:
  GLOO_SOCKET_IFNAME=IF torchrun --nnodes 2 --nproc-per-node 2 --node-rank K \\
      --rdzv-endpoint NODE0_ADDR:29500 sharding.py --layout hsdp --report report.json

--layout fsdp shards every layer over all ranks (a 1-D mesh): each step all-gathers
each layer's parameters in forward and again in backward, and reduce-scatters its
gradients, all over the link. --layout hsdp uses a 2-D mesh (replicate, shard) =
(nodes, ranks per node): the gathers and the reduce-scatter stay inside a node; only
the all-reduce of each rank's gradient shard across the nodes crosses the link.
Local rank 0 of each node reads the node's interface counters around the counted steps
(tx_bytes - 66 * tx_packets: the TCP payload that left the node).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

TIMEOUT = datetime.timedelta(seconds=60)
HEADER_BYTES = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps, per packet


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


def link_counters() -> dict:
    name = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    stats = f"/sys/class/net/{name}/statistics"
    if not name or not os.path.isdir(stats):
        return {"tx_bytes": 0, "tx_packets": 0}
    return {k: int(open(f"{stats}/{k}").read()) for k in ("tx_bytes", "tx_packets")}


def payload(before: dict, after: dict) -> int:
    return ((after["tx_bytes"] - before["tx_bytes"])
            - HEADER_BYTES * (after["tx_packets"] - before["tx_packets"]))


def synchronize(device):
    """Wait for the work queued on this rank's GPU: a collective or a kernel returns once it is
    launched, so a clock read before this would time the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_report(path, report):
    """The report, written whole: a temporary file, then renamed (a file that exists is complete)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)


def main():
    p = argparse.ArgumentParser(description="FSDP2 or HSDP across nodes: bytes on the link")
    p.add_argument("--layout", choices=("fsdp", "hsdp"), default="fsdp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="counted steps (after one warm-up)")
    p.add_argument("--report", help="rank 0 writes the results here, as JSON")
    args = p.parse_args()
    folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.report and not os.path.isdir(folder):
        p.exit(2, f"{p.prog}: error: argument --report: no folder {folder}\n")  # one line, no group
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world, local_rank = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    nodes = world // local_world
    if args.layout == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device.type, (nodes, local_world),
                                mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width, bias=False)
                            for _ in range(args.layers))).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root holds no parameters of its own
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, args.width, device=device)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # warm-up: FSDP's lazy initialisation
    dist.barrier()
    before = link_counters() if local_rank == 0 else None
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    seconds = time.perf_counter() - start
    dist.barrier()
    sent = payload(before, link_counters()) if local_rank == 0 else 0
    per_node = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(per_node, torch.tensor([sent], device=device))
    shard_bytes = sum(q.to_local().numel() * q.element_size() for q in model.parameters())
    param_bytes = shard_bytes * (world if args.layout == "fsdp" else local_world)
    if rank == 0:
        result = {"layout": args.layout, "world": world, "nodes": nodes, "local_world": local_world,
                  "steps": args.steps, "param_bytes": param_bytes, "seconds": seconds,
                  "payload_per_node": [int(per_node[n * local_world]) for n in range(nodes)]}
        print(json.dumps(result))
        if args.report:
            write_report(args.report, {"checks": [], **result})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
