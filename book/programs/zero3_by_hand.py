"""ZeRO stage 3 by hand: what FSDP does, in plain torch.distributed.

Run:  torchrun --standalone --nproc-per-node=2 zero3_by_hand.py
      torchrun --standalone --nproc-per-node=2 zero3_by_hand.py --report report.json
                (rank 0 also writes the check, every rank's shards, the collectives of one
                 step and the bytes held between steps as JSON)

Each rank keeps a flat S(0) shard of every parameter: the parameter is
flattened, padded with zeros to a multiple of the number of ranks, and rank r
keeps the r-th piece. Adam sees only the shards. Hooks on each layer:

* before its forward: all-gather the full parameters (S(0) -> B);
* after its forward: free them (the shard stays);
* when the gradient of its output arrives: all-gather them again for backward;
* when a parameter's gradient is complete: reduce-scatter it into the shard's
  gradient (P -> S(0), added to it, so micro-batches accumulate) and free the
  full gradient and parameter.

It shards each layer's own parameters, so it refuses, in one line, a model whose
layers share a parameter (tied weights), a layer that owns parameters and has
parts that own some (nn.MultiheadAttention reads out_proj.weight without calling
out_proj), and a layer that does not return one tensor. Between steps the full
parameters are freed: read the shards, or gather them.

Source: the ZeRO paper's stage 3 (no source article covers sharding).
"""

import argparse
import datetime
import json
import os
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

# float64 makes the comparison with one process tight (1e-12); training normally uses float32.
torch.set_default_dtype(torch.float64)
STEPS, BATCH, LR = 3, 12, 0.05
CALLS = Counter()  # collectives started, by name

# torch 2.14 renamed the single-tensor collectives; older releases have only the old names.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedParameter:
    """One parameter stored as this rank's flat, padded piece; the full tensor only while in use."""

    def __init__(self, param, rank, world):
        self.param, self.world, self.numel = param, world, param.numel()
        self.shard_numel = -(-self.numel // world)  # ceil(numel / world)
        # `full` is the padded buffer the all-gather fills; the parameter is a view of it.
        self.full = torch.zeros(self.shard_numel * world, dtype=param.dtype, device=param.device)
        self.full[: self.numel] = param.detach().reshape(-1)
        begin = rank * self.shard_numel
        self.shard = nn.Parameter(self.full[begin:begin + self.shard_numel].clone())
        param.data = self.full[: self.numel].view(param.shape)
        self.free()

    def gather(self):  # S(0) -> B
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        all_gather(self.full, self.shard.detach())
        CALLS["all_gather"] += 1

    def free(self):  # the parameter object stays (autograd holds it); its memory goes
        self.full.untyped_storage().resize_(0)

    def reduce_gradient(self):  # P -> S(0), averaged like DDP
        padded = torch.zeros_like(self.full)
        padded[: self.numel] = self.param.grad.reshape(-1)
        shard_grad = torch.empty_like(self.shard)
        reduce_scatter(shard_grad, padded, op=dist.ReduceOp.SUM)
        CALLS["reduce_scatter"] += 1
        if self.shard.grad is None:
            self.shard.grad = shard_grad / self.world
        else:  # several backward passes before a step: accumulate, as plain PyTorch does
            self.shard.grad += shard_grad / self.world
        self.param.grad = None
        self.free()


def shard_model(model, rank, world):
    """Replace every layer's parameters by shards and hook the layer; returns the shards."""
    owners = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners:  # tied weights: two layers would free and gather one tensor
            raise ValueError(f"{name} is the same tensor as {owners[id(p)]} (tied weights): "
                             "shard_model shards each layer's own parameters and cannot share one")
        owners[id(p)] = name
    for name, layer in model.named_modules():
        # parameters(recurse=False), not _parameters: a LayerNorm without affine weights
        # registers weight=None and bias=None, entries that hold no parameter
        inner = [n for n, m in layer.named_modules()
                 if m is not layer and any(True for _ in m.parameters(recurse=False))]
        if any(True for _ in layer.parameters(recurse=False)) and inner:  # its forward may read them
            raise ValueError(f"{name or 'the model'} ({type(layer).__name__}) owns parameters and so "
                             f"does its part {inner[0]}: shard_model hooks layers without such parts")
    shards = []
    for layer in model.modules():
        own = [ShardedParameter(p, rank, world) for p in layer.parameters(recurse=False)]
        if not own:
            continue
        shards += own

        def before_forward(layer, args, own=own):
            for s in own:
                s.gather()

        def after_forward(layer, args, output, own=own):
            for s in own:
                s.free()
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"{type(layer).__name__} returned {type(output).__name__}: "
                                "shard_model hooks layers that return one tensor")
            if output.requires_grad:  # not under torch.no_grad()
                def gather_for_backward(grad):
                    for s in own:
                        s.gather()

                # runs when the output's gradient is ready, just before this layer's backward
                output.register_hook(gather_for_backward)

        layer.register_forward_pre_hook(before_forward)
        layer.register_forward_hook(after_forward)
        for s in own:
            s.param.register_post_accumulate_grad_hook(lambda param, s=s: s.reduce_gradient())
    return shards


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


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
    parser = Parser(prog="zero3_by_hand.py", description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the check and what it counted here, as JSON")
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

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 6, generator=generator).to(device)
    targets = torch.randn(BATCH, 3, generator=generator).to(device)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's samples

    model = make_model().to(device)
    names = [name for name, _ in model.named_parameters()]
    shards = shard_model(model, rank, world)
    for name, s in zip(names, shards):
        padding = s.shard_numel * world - s.numel
        print(f"[rank {rank}] {name:8s} {s.numel:3d} elements -> shard of {s.shard_numel}"
              + (f" (the flat tensor ends with {padding} zero{'s' * (padding > 1)} of padding)"
                 if padding else "") + "\n", end="", flush=True)  # one write: the ranks' lines never mix
    ranks = [None] * world
    dist.all_gather_object(ranks, {"rank": rank, "parameters": [  # every rank's, for --report
        {"name": name, "elements": s.numel, "shard": s.shard_numel, "padding": s.shard_numel * world - s.numel}
        for name, s in zip(names, shards)]})

    optimizer = torch.optim.Adam([s.shard for s in shards], lr=LR)
    for _ in range(STEPS):
        CALLS.clear()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()  # Adam on the shards only
    one_step = dict(CALLS)
    held = sum(s.full.untyped_storage().nbytes() for s in shards)
    shard_bytes = sum(s.shard.numel() * s.shard.element_size() for s in shards)

    # The full parameters, gathered one last time, against one process on the full batch.
    reference = make_model().to(device)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    for _ in range(STEPS):
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    difference = 0.0
    for s, q in zip(shards, reference.parameters()):
        s.gather()
        difference = max(difference, (s.param - q).abs().max().item())
        s.free()

    if rank == 0:
        print(f"collectives of one step: {one_step} "
              f"(one all-gather per parameter in forward and one in backward, one reduce-scatter)")
        print(f"between steps rank 0 holds {shard_bytes} bytes of shards and {held} bytes of full "
              "parameters")
    ok = difference <= 1e-12 and held == 0
    if rank == 0:
        name = f"ZeRO-3 by hand on {world} ranks equals one process on the full batch"
        print(f"check {'passed' if ok else 'FAILED'}: {name}, max |difference| {difference:.1e} <= 1e-12")
        if args.report:
            write_report(args.report, {
                "program": "zero3_by_hand.py", "world": world, "ranks": ranks,
                "collectives_of_one_step": one_step,
                "between_steps": {"shard_bytes": shard_bytes, "full_parameter_bytes": held},
                "checks": [{"name": name, "ok": ok, "difference": difference, "tolerance": 1e-12}]})
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main(parse_args())
