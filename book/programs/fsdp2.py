"""FSDP2: every parameter, gradient and optimizer state split over the ranks (ZeRO stage 3).

Run:  torchrun --standalone --nproc-per-node=2 fsdp2.py
      torchrun --standalone --nproc-per-node=2 fsdp2.py --report report.json
                (rank 0 also writes the checks, every rank's shards, the collectives and the
                 mixed-precision dtypes as JSON)

fully_shard() is called on each layer, then on the whole model. Each parameter
becomes a DTensor with placement Shard(0): every rank stores a slice of rows.
Before a layer runs, FSDP all-gathers its parameters (S(0) -> B) and frees them
afterwards; after backward it reduce-scatters the gradients (P -> S(0)), so
Adam updates only this rank's rows. The program prints the shards, counts the
collectives of one step, and checks the result against one process.

Source: PyTorch's FSDP2 (fully_shard) documentation and the ZeRO paper (no source article covers sharding).
"""

import argparse
import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

# float64 makes the comparison with one process tight (1e-12); training normally uses float32.
torch.set_default_dtype(torch.float64)
# FSDP2 warns when a wrapped model returns a view: changing it in place would skip FSDP's
# backward hook. Nothing here changes an output in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
STEPS, BATCH, LR = 3, 12, 0.05
SBP = {"_allgather_base_": "all_gather      S(0) -> B", "_reduce_scatter_base_": "reduce_scatter  P -> S(0)",
       "allreduce_": "all_reduce      P -> B"}


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


def shard(model, mesh, **options):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **options)  # one all-gather per layer
    fully_shard(model, mesh=mesh, **options)  # the root: whatever the layers did not take
    return model


def counted(action):
    """The collectives that `action()` starts, by name."""
    with CommDebugMode() as mode:
        result = action()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
    return result, counts


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


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (from rank 0 only) and exit status 2
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)


def parse_args(argv=None):
    """Checked before any process group: where the report goes must exist."""
    parser = Parser(prog="fsdp2.py", description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the checks and what they counted here, as JSON")
    args = parser.parse_args(argv)
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    return args


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main(args):
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 6, generator=generator).to(device)
    targets = torch.randn(BATCH, 3, generator=generator).to(device)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's samples

    model = shard(make_model().to(device), mesh)
    shards = []
    for name, p in model.named_parameters():
        print(f"[rank {rank}] {name:8s} global {tuple(p.shape)} -> local {tuple(p.to_local().shape)}, "
              f"placements {p.placements}\n", end="", flush=True)  # one write: the ranks' lines never mix
        shards.append({"name": name, "global": list(p.shape), "local": list(p.to_local().shape),
                       "placements": str(p.placements)})
    ranks = [None] * world
    dist.all_gather_object(ranks, {"rank": rank, "parameters": shards})  # every rank's, for --report

    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss, forward = counted(lambda: nn.functional.mse_loss(model(inputs[mine]), targets[mine]))
        _, backward = counted(loss.backward)
        _, update = counted(optimizer.step)
    if rank == 0:
        print(f"collectives of one training step on {world} ranks:")
        for phase, counts in (("forward", forward), ("backward", backward), ("optimizer.step", update)):
            for op, n in counts.items():
                print(f"  {phase:15s} {SBP.get(op, op):27s} x{n}")
            if not counts:
                print(f"  {phase:15s} none")

    # reshard_after_forward=False keeps each layer's full parameters from forward to backward:
    # more memory, and no second all-gather in backward.
    kept = shard(make_model().to(device), mesh, reshard_after_forward=False)
    loss = nn.functional.mse_loss(kept(inputs[mine]), targets[mine])
    _, kept_backward = counted(loss.backward)
    if rank == 0:
        print(f"reshard_after_forward=False, backward: {kept_backward}")

    # The full parameters, gathered (S(0) -> B), against one process on the full batch.
    reference = make_model().to(device)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    for _ in range(STEPS):
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    difference = max((p.full_tensor() - q).abs().max().item()
                     for p, q in zip(model.parameters(), reference.parameters()))

    # Mixed precision: parameters stored in float32, all-gathered and computed in bfloat16,
    # gradients reduced in float32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = shard(make_model().to(device=device, dtype=torch.float32), mesh, mp_policy=policy)
    seen = {}
    mixed[0].register_forward_pre_hook(lambda layer, args: seen.update(computed=layer.weight.dtype))
    output = mixed(inputs[mine].float())
    output.float().pow(2).mean().backward()
    if rank == 0:
        print(f"mixed precision: stored {mixed[0].weight.dtype}, computed {seen['computed']}, "
              f"output {output.dtype}, gradient {mixed[0].weight.grad.dtype}")
        checks = [{"name": f"FSDP2 on {world} ranks equals one process on the full batch",
                   "ok": difference <= 1e-12, "difference": difference, "tolerance": 1e-12},
                  {"name": "all-gathers in forward, reduce-scatters in backward",
                   "ok": "_reduce_scatter_base_" in backward and "_allgather_base_" in forward}]
        print(f"check {'passed' if checks[0]['ok'] else 'FAILED'}: {checks[0]['name']}, "
              f"max |difference| {difference:.1e} <= 1e-12")
        print(f"check {'passed' if checks[1]['ok'] else 'FAILED'}: {checks[1]['name']}")
        ok = all(check["ok"] for check in checks)
        if args.report:
            write_report(args.report, {
                "program": "fsdp2.py", "world": world, "checks": checks, "ranks": ranks,
                "collectives": {"forward": forward, "backward": backward, "optimizer.step": update,
                                "backward, reshard_after_forward=False": kept_backward},
                "mixed_precision": {"stored": str(mixed[0].weight.dtype), "computed": str(seen["computed"]),
                                    "output": str(output.dtype), "gradient": str(mixed[0].weight.grad.dtype)}})
    else:
        ok = True
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main(parse_args())
