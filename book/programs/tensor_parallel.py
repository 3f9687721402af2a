"""Tensor parallelism: an MLP, an attention block and sequence parallelism, split over ranks.

Run:  torchrun --standalone --nproc-per-node=2 tensor_parallel.py
      torchrun --standalone --nproc-per-node=2 tensor_parallel.py --report report.json
                (rank 0 also writes the checks as JSON: name, case, ok, worst, collectives)

Every rank also builds the plain (unsplit) module from the same seed and runs it
on the same input: that is what one process would compute. The split version
must give the same output and the same gradients (float64, to 1e-12).
Gloo on CPU; nccl with one GPU per rank when there are enough GPUs.

Source: PyTorch's tensor-parallel documentation and the Megatron-LM paper (no source article covers it).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Shard

DIM, HIDDEN, HEADS, BATCH, SEQ = 16, 64, 4, 2, 8
TOLERANCE = 1e-12


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        batch, seq, _ = x.shape
        # -1 heads: all of them on one process, this rank's share under tensor parallelism
        # (q, k and v are split by output features, which are whole heads).
        q, k, v = (f(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """LayerNorm then MLP, with a residual connection (half of a transformer layer)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def cases():
    """Each case: its title, the module, its plan, and the input dimension split over ranks."""
    return {
        "mlp": ("MLP", MLP, {"up": ColwiseParallel(), "down": RowwiseParallel()}, None),
        "attention": ("Attention", Attention,
                      {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                       "out": RowwiseParallel()}, None),
        # Sequence parallelism: the norm runs on a slice of the sequence; the MLP
        # all-gathers the sequence on the way in and reduce-scatters it on the way out.
        "sequence_parallel": ("Sequence parallel", Block,
                              {"norm": SequenceParallel(),
                               "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
                               "mlp.down": RowwiseParallel(output_layouts=Shard(1))}, 1),
    }


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (from rank 0 only) and exit status 2
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)


def parse_args(argv=None):
    """Before any process group: the heads and positions must split evenly over the ranks."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the checks here, as JSON")
    args = parser.parse_args(argv)
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if "WORLD_SIZE" not in os.environ:
        parser.error("start it with torchrun: "
                     "torchrun --standalone --nproc-per-node=2 tensor_parallel.py")
    if HEADS % int(os.environ["WORLD_SIZE"]) or SEQ % int(os.environ["WORLD_SIZE"]):
        parser.error(f"--nproc-per-node={os.environ['WORLD_SIZE']}: the {HEADS} heads and {SEQ} "
                     "positions must split evenly over the ranks (use 1, 2 or 4)")
    return args


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


def setup():
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    return device.type


def collectives(mode):
    """CommDebugMode's counts with short names: {'all_reduce': 1}."""
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()} or "none"


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def worst_on_any_rank(differences, device_type):
    """The largest difference over every rank (each rank checked its own piece)."""
    worst = torch.tensor(max(differences), dtype=torch.float64, device=device_type)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def show_parameters(model):
    say(f"  {'parameter':16}{'placements':19}{'local shape':13}{'global shape':14}gradient")
    for name, p in model.named_parameters():
        say(f"  {name:16}{str(p.placements):19}{str(tuple(p.to_local().shape)):13}"
            f"{str(tuple(p.shape)):14}{p.grad.placements}")


def compare(name, device_type, make, plan, x, shard_input_dim=None):
    """Run the plain module and its parallelized twin on ``x``; check output and gradients."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    torch.manual_seed(0)
    plain = make().to(device_type, torch.float64)
    split = make().to(device_type, torch.float64)
    split.load_state_dict(plain.state_dict())
    seen = {}

    def record(mod, inputs, out):  # returns None: the output stays as it is
        seen.setdefault(mod.plan_name, out.placements)

    for sub in plan:  # registered before parallelize_module: sees the raw result of the matmul
        split.get_submodule(sub).plan_name = sub
        split.get_submodule(sub).register_forward_hook(record)
    parallelize_module(split, mesh, plan)
    say(f"== {name}: plan {', '.join(f'{k}: {type(v).__name__}' for k, v in plan.items())}")

    x_plain = x.clone().requires_grad_(True)
    expected = plain(x_plain)
    expected.pow(2).sum().backward()
    # Under sequence parallelism each rank holds a slice of the sequence, in and out.
    rank = dist.get_rank()
    x_mine = x if shard_input_dim is None else x.chunk(mesh.size(), shard_input_dim)[rank]
    x_mine = x_mine.clone().requires_grad_(True)
    with CommDebugMode() as forward:
        out = split(x_mine)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    show_parameters(split)
    for sub, placements in seen.items():
        style = plan[sub]
        hands_on = getattr(style, "output_layouts", getattr(style, "sequence_sharding", None))
        say(f"  {sub} computes {placements} and hands on {hands_on}")
    say(f"  collectives: forward {collectives(forward)}, backward {collectives(backward)}")

    want = expected if shard_input_dim is None else expected.chunk(mesh.size(), shard_input_dim)[rank]
    differences = [(out - want).abs().max().item()]
    grads = dict(split.named_parameters())
    for pname, p in plain.named_parameters():
        g = grads[pname].grad
        full = g.full_tensor() if isinstance(g, DTensor) else g
        differences.append((full - p.grad).abs().max().item())
    x_grad = x_plain.grad if shard_input_dim is None else \
        x_plain.grad.chunk(mesh.size(), shard_input_dim)[rank]
    differences.append((x_mine.grad - x_grad).abs().max().item())
    worst = worst_on_any_rank(differences, device_type)
    ok = worst <= TOLERANCE
    say(f"  check: output, input gradient and every parameter gradient equal to the plain "
        f"module on every rank: max difference {worst:.1e} <= {TOLERANCE:g}: "
        f"{'OK' if ok else 'FAILED'}")
    return {"name": "output, input gradient and every parameter gradient equal to the plain module",
            "case": name, "ok": ok, "worst": worst, "tolerance": TOLERANCE,
            "collectives": {"forward": collectives(forward), "backward": collectives(backward)}}


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main():
    args = parse_args()
    device_type = setup()
    world = dist.get_world_size()
    say(f"{world} ranks, backend {dist.get_backend()}, device {device_type}, float64")
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64, device=device_type)

    checks = [compare(title, device_type, make, plan, x, shard_input_dim)
              for title, make, plan, shard_input_dim in cases().values()]
    results = [check["ok"] for check in checks]
    say("all checks passed" if all(results) else "SOME CHECKS FAILED")
    if args.report and dist.get_rank() == 0:
        write_report(args.report, {"program": "tensor_parallel.py", "world": world, "checks": checks})
    dist.destroy_process_group()
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
