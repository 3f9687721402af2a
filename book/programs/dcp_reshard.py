"""A sharded checkpoint saved by N ranks and loaded by M: torch.distributed.checkpoint.

Run:  torchrun --standalone --nproc-per-node=2 dcp_reshard.py            # train, save
      torchrun --standalone --nproc-per-node=3 dcp_reshard.py --load     # load, check
      (--report FILE: rank 0 also writes the check as JSON: saved_by, loaded_by, identical, tensors)

An FSDP2 model and its Adam state are sharded over the ranks. Each rank saves
only its own shards, and the checkpoint's metadata records which piece of which
tensor each file holds. Loading asks for the pieces the *current* ranks own,
whatever the number of ranks that wrote them. The save also keeps a full copy
of every tensor (full_state.pt, only for the check); the load compares every
model and optimizer tensor with it (torch.equal: exact).
Gloo on CPU; on GPUs nccl with one GPU per rank, and gloo beside it for CPU tensors
("cpu:gloo,cuda:nccl", which dcp.async_save needs).

Source: PyTorch's distributed-checkpoint documentation (no source article covers it).
"""

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DIM, HIDDEN, LAYERS, BATCH, STEPS = 8, 20, 2, 12, 2  # 20 rows: 10 + 10 on 2 ranks, 7 + 7 + 6 on 3
FULL_COPY = "full_state.pt"


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


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="dcp_checkpoint", help="checkpoint directory")
    parser.add_argument("--load", action="store_true", help="load and check instead of save")
    parser.add_argument("--report", help="also write the check here, as JSON")
    args = parser.parse_args()
    directory = Path(args.dir)
    # Check before any process group or file exists; one line, exit 2.
    problem = None
    world = os.environ.get("WORLD_SIZE")
    report_folder = os.path.dirname(os.path.abspath(args.report or "."))
    if args.report and not os.path.isdir(report_folder):
        problem = f"--report {args.report}: no folder {report_folder}"
    elif world is None:
        problem = "start it with torchrun: torchrun --standalone --nproc-per-node=2 dcp_reshard.py"
    elif not args.load and BATCH % int(world):
        problem = (f"--nproc-per-node={world}: the batch of {BATCH} must split evenly over the "
                   "ranks that save (use 1, 2, 3, 4, 6 or 12)")
    elif args.load and not (directory / ".metadata").is_file():
        problem = f"--dir {args.dir!r}: no checkpoint there (save one first, without --load)"
    elif not args.load and not directory.resolve().parent.is_dir():
        problem = f"--dir {args.dir!r}: its parent directory does not exist"
    elif not args.load and directory.exists() and any(directory.iterdir()) \
            and not (directory / ".metadata").is_file():
        problem = f"--dir {args.dir!r}: exists and is not a checkpoint; refusing to overwrite it"
    if problem:
        if os.environ.get("RANK", "0") == "0":
            print(problem, file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)
    return directory, args.load, args.report


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
    # On GPUs: nccl for CUDA tensors and gloo for CPU ones. dcp.async_save refuses a group
    # without a CPU backend ("A CPU backend must be enabled for async save"): it stages the
    # state in CPU memory and writes it in the background. Plain "nccl" would not do.
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    return device.type


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def build(device_type, seed):
    """The model sharded over every rank (FSDP2), and Adam over its shards."""
    torch.manual_seed(seed)
    model = Model().to(device_type)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def show_pieces(model, what):
    """Rows of the first weight that each rank holds."""
    weight = model.layers[0].up.weight
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, weight.to_local().shape[0])
    say(f"{what} by {dist.get_world_size()} ranks: layers.0.up.weight {tuple(weight.shape)} "
        f"{weight.placements}, rows per rank {rows}")


def full_state(model, optimizer):
    """Every tensor gathered whole, on rank 0 only (the other ranks get empty dicts)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


def tensors(tree, prefix=""):
    """(name, tensor) for every tensor in nested dicts and lists."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from tensors(value, f"{prefix}.{i}")


def save(directory, device_type):
    model, optimizer = build(device_type, seed=0)
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, DIM, device=device_type), torch.randn(BATCH, DIM, device=device_type)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(STEPS):  # a few steps, so that Adam has state worth saving
        optimizer.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        optimizer.step()
    show_pieces(model, "trained")
    # Not atomic: a kill between these lines loses the old checkpoint (see the chapter).
    if rank == 0 and directory.exists():
        shutil.rmtree(directory)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards (DTensors)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save({"saved_by": world, **full}, directory / FULL_COPY)
    dist.barrier()
    files = sorted(p.name for p in directory.iterdir())
    say(f"saved {directory}: {files}")
    chunks = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    say("its metadata, pieces of model.layers.0.up.weight:",
        [(tuple(c.offsets), tuple(c.sizes)) for c in chunks["model.layers.0.up.weight"].chunks])
    return True


def load(directory, device_type, checks):
    model, optimizer = build(device_type, seed=123)  # other weights: loading must replace them
    # The state dicts of *this* world's shards are the template: dcp.load fills them in
    # place, reading from each file the part of each tensor that this rank owns now.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    show_pieces(model, "loaded")
    full = full_state(model, optimizer)
    ok = True
    if dist.get_rank() == 0:
        saved = torch.load(directory / FULL_COPY, weights_only=True)
        mine, theirs = dict(tensors(full)), dict(tensors({k: saved[k] for k in ("model", "optim")}))
        same = [name for name in theirs if name in mine and torch.equal(mine[name], theirs[name])]
        ok = len(same) == len(theirs) == len(mine)
        print(f"check: saved by {saved['saved_by']} ranks, loaded by {dist.get_world_size()}: "
              f"{len(same)} of {len(theirs)} tensors (model and Adam state) identical: "
              f"{'OK' if ok else 'FAILED'}", flush=True)
        checks.append({"name": f"saved by {saved['saved_by']} ranks, loaded by {dist.get_world_size()}",
                       "ok": ok, "saved_by": saved["saved_by"], "loaded_by": dist.get_world_size(),
                       "identical": len(same), "tensors": len(theirs)})
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main():
    directory, loading, report = parse_args()
    device_type = setup()
    checks = []  # the load's check (rank 0); a save checks nothing
    ok = load(directory, device_type, checks) if loading else save(directory, device_type)
    if report and dist.get_rank() == 0:
        write_report(report, {"program": "dcp_reshard.py", "world": dist.get_world_size(),
                              "loaded": loading, "checks": checks})
    if not loading:
        say(f"now load it with another number of ranks, e.g.\n  torchrun --standalone "
            f"--nproc-per-node=3 {Path(sys.argv[0]).name} --dir {directory} --load")
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
