"""All-reduce across two nodes: flat ring against hierarchical, timed and counted on the link.

Run on each node K of 2 (ranks 0..L-1 on node 0, L..2L-1 on node 1):
  GLOO_SOCKET_IFNAME=IF torchrun --nnodes 2 --nproc-per-node 2 --node-rank K \\
      --rdzv-endpoint NODE0_ADDR:29500 collectives.py --report report.json

Five measurements, each repeated and its fastest kept:
0. the latency: rank 0 and rank L (node 1) pass a 4-byte message back and forth, and
   half the median round trip is one message's time; the same inside node 0;
1. a sweep of point-to-point sends from rank 0 (node 0) to rank L (node 1): the time of
   n bytes is fitted as a line, whose slope is the link's bandwidth (for messages this
   large the intercept is not the latency: see the chapter); the same from rank 0 to
   rank 1 (inside node 0: loopback);
2. a flat all-reduce of every rank's tensor over the whole group;
3. a hierarchical all-reduce: reduce-scatter inside each node, all-reduce of each slice
   across the nodes (ranks with the same local rank), all-gather inside each node. It
   gives the same sum (checked) and sends fewer bytes over the link;
4. an all-gather and a reduce-scatter over the whole group, each alone.
Local rank 0 of each node reads its node's interface counters
(/sys/class/net/IF/statistics, which ip netns exec shows for the node's namespace)
before and after each phase: tx_bytes - 66 * tx_packets is the TCP payload that left
the node (each packet carries 14 bytes of Ethernet, 20 of IPv4 and 32 of TCP header).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

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
    """This node's interface counters (the interface gloo/nccl were told to use)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    stats = f"/sys/class/net/{name}/statistics"
    if not name or not os.path.isdir(stats):
        return {"tx_bytes": 0, "tx_packets": 0}
    return {k: int(open(f"{stats}/{k}").read()) for k in ("tx_bytes", "tx_packets")}


def payload(before: dict, after: dict) -> int:
    """TCP payload bytes that left the node between two readings."""
    return ((after["tx_bytes"] - before["tx_bytes"])
            - HEADER_BYTES * (after["tx_packets"] - before["tx_packets"]))


def hierarchical_all_reduce(x, node_group, cross_group, local_world):
    """Sum ``x`` over all ranks: inside the node, across the nodes, inside the node again."""
    piece = torch.empty(x.numel() // local_world, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(piece, x, group=node_group)  # my slice, summed over my node
    dist.all_reduce(piece, group=cross_group)               # and over the other nodes
    dist.all_gather_single(x, piece, group=node_group)  # every slice back on every rank
    return x


def synchronize(device):
    """Wait for the work queued on this rank's GPU: a collective or a kernel returns once it is
    launched, so a clock read before this would time the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured(phase, repeats, local_rank, world, device):
    """Run ``phase`` ``repeats`` times between barriers: its fastest time (the slowest
    rank's) and the payload this node sent in the last repeat."""
    best, sent = float("inf"), 0
    for _ in range(repeats):
        dist.barrier()
        before = link_counters() if local_rank == 0 else None
        dist.barrier()
        start = time.perf_counter()
        phase()
        synchronize(device)
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.barrier()
        if local_rank == 0:
            sent = payload(before, link_counters())
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        best = min(best, took.item())
    return best, sent


def latency(peer, rank, round_trips, device):
    """Half the median round trip of a 4-byte message between rank 0 and ``peer``."""
    token = torch.zeros(1, dtype=torch.int32, device=device)
    times = []
    dist.barrier()
    for _ in range(round_trips):
        if rank == 0:
            start = time.perf_counter()
            dist.send(token, dst=peer)
            dist.recv(token, src=peer)
            synchronize(device)
            times.append(time.perf_counter() - start)
        elif rank == peer:
            dist.recv(token, src=0)
            dist.send(token, dst=0)
    dist.barrier()
    return sorted(times)[len(times) // 2] / 2 if times else 0.0


def write_report(path, report):
    """The report, written whole: a temporary file, then renamed (a file that exists is complete)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)


def main():
    p = argparse.ArgumentParser(description="flat and hierarchical all-reduce across nodes")
    p.add_argument("--sizes", default="1048576,2097152,4194304,8388608",
                   help="bytes sent point to point in the sweep (comma-separated)")
    p.add_argument("--numel", type=int, default=2**21, help="float32 elements all-reduced")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--round-trips", type=int, default=50, help="of the latency ping-pong")
    p.add_argument("--report", help="rank 0 writes the check and the results here, as JSON")
    args = p.parse_args()
    folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.round_trips < 1 or args.repeats < 1:
        p.exit(2, f"{p.prog}: error: --round-trips and --repeats must be at least 1\n")
    if args.report and not os.path.isdir(folder):
        p.exit(2, f"{p.prog}: error: argument --report: no folder {folder}\n")  # one line, no group
    device = rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world, local_rank = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    nodes = world // local_world
    node = rank // local_world
    node_groups = [dist.new_group(list(range(n * local_world, (n + 1) * local_world)))
                   for n in range(nodes)]
    cross_groups = [dist.new_group(list(range(j, world, local_world))) for j in range(local_world)]
    node_group, cross_group = node_groups[node], cross_groups[local_rank]

    one_way = {"across": latency(local_world, rank, args.round_trips, device),
               "inside": latency(1, rank, args.round_trips, device)}
    sweep, intra_sweep = [], []
    for size in (int(s) for s in args.sizes.split(",")):
        buf = torch.ones(size, dtype=torch.uint8, device=device)
        for peer, points in ((local_world, sweep), (1, intra_sweep)):  # across, then inside
            def send(buf=buf, peer=peer):
                if rank == 0:
                    dist.send(buf, dst=peer)
                elif rank == peer:
                    dist.recv(buf, src=0)
            seconds, sent = measured(send, args.repeats, local_rank, world, device)
            points.append({"bytes": size, "seconds": seconds, "node0_payload": sent})

    x0 = torch.arange(args.numel, dtype=torch.float32, device=device) % 97 + rank
    flat_x, hier_x = x0.clone(), x0.clone()

    def flat():
        flat_x.copy_(x0)
        dist.all_reduce(flat_x)

    def hier():
        hier_x.copy_(x0)
        hierarchical_all_reduce(hier_x, node_group, cross_group, local_world)

    piece = torch.ones(args.numel // world, dtype=torch.float32, device=device)

    def gather():
        dist.all_gather_single(flat_x, piece)

    def scatter():
        dist.reduce_scatter_single(piece, x0)

    def nothing():
        pass
    results = {}
    phases = (("barrier", nothing), ("flat", flat), ("hierarchical", hier),
              ("all_gather", gather), ("reduce_scatter", scatter))
    for name, phase in phases:
        seconds, sent = measured(phase, args.repeats, local_rank, world, device)
        per_node = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(per_node, torch.tensor([sent], device=device))  # local rank 0's count of each node
        results[name] = {"seconds": seconds,
                         "payload_per_node": [int(per_node[n * local_world]) for n in range(nodes)]}
    flat()
    same = torch.equal(flat_x, hier_x)  # small whole numbers: float32 sums are exact
    if rank == 0:
        print(f"hierarchical == flat: {same}")
        print(f"latency: {one_way['across'] * 1e6:.0f} us across the link, "
              f"{one_way['inside'] * 1e6:.0f} us inside node 0")
        for name in ("flat", "hierarchical"):
            r = results[name]
            print(f"{name}: {r['seconds'] * 1e3:.1f} ms, payload out of each node "
                  f"{r['payload_per_node']} bytes")
        if args.report:
            write_report(args.report, {
                "checks": [{"name": "hierarchical == flat", "ok": same}], "world": world,
                "nodes": nodes, "local_world": local_world, "numel": args.numel,
                "element_bytes": 4, "latency": one_way, "sweep": sweep, "intra_sweep": intra_sweep,
                "same_sum": same, **results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
