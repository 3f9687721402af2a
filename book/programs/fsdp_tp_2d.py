"""Two-dimensional parallelism on a 2x2 mesh: FSDP x tensor parallelism, then HSDP.

Run:  torchrun --standalone --nproc-per-node=4 fsdp_tp_2d.py
      torchrun --standalone --nproc-per-node=4 fsdp_tp_2d.py --report report.json
                (rank 0 also writes the checks as JSON: name, layout, ok, worst, losses)

Part 1: mesh ("dp", "tp"). Tensor parallelism splits every MLP across the two
ranks of a "tp" row; FSDP2 shards the result again across the two ranks of a
"dp" column. Each "dp" index reads half of the batch.
Part 2: HSDP, ``fully_shard`` on a 2-D mesh ("replicate", "shard"): parameters
sharded within a row and replicated across rows; each of the 4 ranks reads a
quarter of the batch.
Both are checked against one process that trains the same model on the whole
batch with the same SGD steps (float64, to 1e-12).

Source: PyTorch's FSDP2 and tensor-parallel documentation (no source article covers it).
"""

import argparse
import datetime
import json
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM, HIDDEN, LAYERS, BATCH, STEPS, LR = 8, 32, 2, 8, 3, 0.1
TIMEOUT = datetime.timedelta(seconds=60)
TOLERANCE = 1e-12


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


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
    # FSDP2 warns that a layer returns a view (the model adds it out of place, which is safe),
    # and DTensor that full_tensor() of a 2-D sharded weight takes two all-gathers (it does).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return device.type


def mesh_2d(device_type, names):
    """A 2x2 mesh. It makes one process group per mesh dimension; without these
    options they would get c10d's default timeout, not TIMEOUT (30 minutes on gloo,
    10 on nccl), and wait that long for a peer that never comes."""
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
    else:
        options = dist.ProcessGroupGloo.Options("gloo", TIMEOUT)
    return init_device_mesh(device_type, (2, 2), mesh_dim_names=names,
                            backend_override={name: options for name in names})


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def data(device_type):
    torch.manual_seed(1)
    x = torch.randn(BATCH, DIM, dtype=torch.float64, device=device_type)
    return x, torch.randn(BATCH, DIM, dtype=torch.float64, device=device_type)


def train(model, x, y, dp_group=None, dp_size=1):
    """SGD on this rank's share of the batch; the loss recorded is the whole batch's mean."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        # A mean over each share; FSDP averages the gradients over the data-parallel ranks,
        # so the step is that of the mean over the whole batch (the shares are equal).
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / dp_size)
    return losses


def reference(device_type, x, y):
    """One process, the whole batch: the losses and weights every layout must reproduce."""
    torch.manual_seed(0)
    model = Model().to(device_type, torch.float64)
    return model, train(model, x, y)


def show_rows(name, weight):
    """Which rows of the whole weight each rank holds (found by comparing with full_tensor)."""
    full, local = weight.full_tensor(), weight.to_local()
    first = next(r for r in range(full.shape[0]) if torch.equal(full[r], local[0]))
    starts = [None] * dist.get_world_size()
    dist.all_gather_object(starts, first)
    say(f"  rows of {name} on ranks 0-3: "
        + ", ".join(f"{s}-{s + local.shape[0] - 1}" for s in starts))


def check(model, losses, plain, plain_losses):
    say(f"  {'parameter':22}{'placements':44}local shape")
    for pname, p in model.named_parameters():
        say(f"  {pname:22}{str(p.placements):44}{tuple(p.to_local().shape)}")
    show_rows("layers.0.up.weight", model.layers[0].up.weight)
    say(f"  loss per step {[f'{v:.6f}' for v in losses]}")
    say(f"  one process   {[f'{v:.6f}' for v in plain_losses]}")
    plain_params = dict(plain.named_parameters())
    differences = [abs(a - b) for a, b in zip(losses, plain_losses)]
    differences += [(p.full_tensor() - plain_params[pname]).abs().max().item()
                    for pname, p in model.named_parameters()]
    device = next(plain.parameters()).device
    worst = torch.tensor(max(differences), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= TOLERANCE
    say(f"  check: losses and weights after {STEPS} SGD steps equal to one process on the whole "
        f"batch, on every rank: max difference {worst.item():.1e} <= {TOLERANCE:g}: "
        f"{'OK' if ok else 'FAILED'}")
    return {"name": f"losses and weights after {STEPS} SGD steps equal to one process",
            "ok": ok, "worst": worst.item(), "tolerance": TOLERANCE, "losses": losses}


def shard_fsdp_x_tp(model, mesh):
    for layer in model.layers:
        # tensor parallelism first, within the "tp" row; FSDP then shards the pieces over "dp"
        parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def shard_hsdp(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp_x_tp(device_type, x, y, plain, plain_losses):
    mesh = mesh_2d(device_type, ("dp", "tp"))
    say("== FSDP x TP: mesh", mesh.mesh.tolist(), "dims ('dp', 'tp')")
    torch.manual_seed(0)
    model = shard_fsdp_x_tp(Model().to(device_type, torch.float64), mesh)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    shares = (x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank])  # same share across a tp row
    losses = train(model, *shares, mesh["dp"].get_group(), dp_size)
    return {"layout": "FSDP x TP", **check(model, losses, plain, plain_losses)}


def hsdp(device_type, x, y, plain, plain_losses):
    mesh = mesh_2d(device_type, ("replicate", "shard"))
    say("== HSDP: mesh", mesh.mesh.tolist(), "dims ('replicate', 'shard')")
    torch.manual_seed(0)
    model = shard_hsdp(Model().to(device_type, torch.float64), mesh)
    rank, world = dist.get_rank(), dist.get_world_size()  # every rank is data-parallel here
    losses = train(model, x.chunk(world)[rank], y.chunk(world)[rank], None, world)
    return {"layout": "HSDP", **check(model, losses, plain, plain_losses)}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (from rank 0 only) and exit status 2
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)


def parse_args(argv=None):
    """Checked before any process group exists: one line, exit status 2."""
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the checks here, as JSON")
    args = parser.parse_args(argv)
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if os.environ.get("WORLD_SIZE") != "4":
        parser.error(f"--nproc-per-node={os.environ.get('WORLD_SIZE', '(none)')}: this program needs "
                     "4 ranks (a 2x2 mesh): torchrun --standalone --nproc-per-node=4 fsdp_tp_2d.py")
    return args


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main():
    args = parse_args()
    device_type = setup()
    say(f"4 ranks, backend {dist.get_backend()}, device {device_type}, float64")
    x, y = data(device_type)
    plain, plain_losses = reference(device_type, x, y)
    checks = [fsdp_x_tp(device_type, x, y, plain, plain_losses),
              hsdp(device_type, x, y, plain, plain_losses)]
    results = [check["ok"] for check in checks]
    say("all checks passed" if all(results) else "SOME CHECKS FAILED")
    if args.report and dist.get_rank() == 0:
        write_report(args.report, {"program": "fsdp_tp_2d.py", "checks": checks,
                                   "one_process_losses": plain_losses})
    dist.destroy_process_group()
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
