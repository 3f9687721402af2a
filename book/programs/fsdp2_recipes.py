"""What a real FSDP2 training script needs beyond fully_shard, each checked on 2 ranks.

Run:  torchrun --standalone --nproc-per-node=2 fsdp2_recipes.py
      torchrun --standalone --nproc-per-node=2 fsdp2_recipes.py --report report.json
                (rank 0 also writes the checks as JSON, each with what it counted)

1. Initial weights: fully_shard does not broadcast them (DDP does). Each rank
   keeps its own rows, so ranks seeded differently train a model that never existed.
2. Gradient accumulation (set_requires_gradient_sync) and gradient clipping
   (clip_grad_norm_ on DTensor gradients) against one process on the full batch.
3. A full, unsharded checkpoint loaded into the sharded model and saved back
   (get/set_model_state_dict with full_state_dict=True).
4. Initialisation on the meta device: no rank holds the full model, then the
   shards are filled from the full checkpoint.
5. Tied weights (the output layer shares the embedding's weight) against one process.
6. Activation checkpointing with FSDP2: the same gradients, fewer bytes saved for
   backward, and as many all-gathers (the recomputation reruns each block's MLP inside
   the FSDP unit, whose parameters are gathered for backward anyway: no hook fires again).

Every check prints `check passed: ...` or `check FAILED: ...`, passed only if it passed on
every rank.
Source: PyTorch's FSDP2 API reference and the torch.distributed.checkpoint.state_dict API.
"""

import argparse
import copy
import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint

torch.set_default_dtype(torch.float64)  # tight comparisons with one process (1e-12)
DIM, VOCAB, BATCH, LR = 16, 12, 8, 0.1
CHECKS = []  # every check: its name, whether it passed on every rank, what it counted
DEVICE = torch.device("cpu")  # main() sets the rank's GPU when every rank has one


class Block(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.checkpointed = checkpointed

    def mlp(self, x):
        return self.down(torch.tanh(self.up(x)))

    def forward(self, x):
        if self.checkpointed:  # keep only x; recompute the block in backward
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, tied=False, checkpointed=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(checkpointed) for _ in range(3))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.out.weight = self.embed.weight  # one tensor, used twice

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Model(**kwargs).to(DEVICE)


def shard(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)  # the root unit: embed and out (tied or not)


def full(model):
    """Every parameter as a full tensor (an all-gather of each DTensor)."""
    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def difference(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


def check(ok, message, **counted):
    """Print one check line (rank 0) and keep it for --report; it passes if it passed on every rank."""
    verdict = torch.tensor([int(bool(ok))], device=DEVICE)
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    ok = bool(verdict.item())
    if dist.get_rank() == 0:
        print(f"check {'passed' if ok else 'FAILED'}: {message}", flush=True)
    CHECKS.append({"name": message, "ok": ok, **counted})


def data(steps, micro=1):
    """Token batches and targets, the same on every rank (each rank takes its half)."""
    g = torch.Generator().manual_seed(1)
    def batch():
        return torch.randint(0, VOCAB, (BATCH, 5), generator=g).to(DEVICE)
    return [[(batch(), batch()) for _ in range(micro)] for _ in range(steps)]


def loss_of(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def my_rows(rank, world, rows=VOCAB):
    """The rows of dimension 0 that fully_shard leaves this rank: it splits as torch.chunk
    does, ceil(rows / world) a rank and fewer or none on the last (12 on 5 ranks: 3, 3, 3, 3, 0)."""
    per = -(-rows // world)
    return slice(min(rank * per, rows), min((rank + 1) * per, rows))


def initial_weights(mesh, rank, world):
    own = make(seed=rank)  # as if each rank seeded with its rank, for data or dropout
    sharded = full(shard(copy.deepcopy(own), mesh))
    rank0 = make(seed=0).state_dict()
    mixed = difference(sharded, rank0) > 0 and difference(sharded, own.state_dict()) > 0
    rows = my_rows(rank, world)
    mine = torch.equal(sharded["embed.weight"][rows], own.embed.weight[rows])
    check(mixed and mine, "fully_shard broadcasts nothing: with a seed per rank each rank keeps its "
          "own rows, and the gathered model is neither rank 0's nor this rank's")


def accumulation_and_clipping(mesh, rank, world):
    model, reference = shard(make(), mesh), make()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    reduce_scatters, norms = [], []
    for micro_batches in data(steps=2, micro=2):
        for i, (tokens, targets) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)  # reduce-scatter only after the last
            with CommDebugMode() as comms:
                (loss_of(model, tokens[mine], targets[mine]) / len(micro_batches)).backward()
            reduce_scatters.append(sum(n for op, n in comms.get_comm_counts().items()
                                       if "reduce_scatter" in str(op)))
            (loss_of(reference, tokens, targets) / len(micro_batches)).backward()
        # clip_grad_norm_ on DTensor gradients: the norm of the whole gradient, over all ranks
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        reference_norm = nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        norms.append((norm - reference_norm).abs().item())
        optimizer.step(), optimizer.zero_grad()
        reference_optimizer.step(), reference_optimizer.zero_grad()
    check(reduce_scatters == [0, 4, 0, 4], f"set_requires_gradient_sync(False) skips the reduce-scatters: "
          f"per micro-batch {reduce_scatters} (4 units)", reduce_scatters_per_micro_batch=reduce_scatters)
    diff = difference(full(model), dict(reference.named_parameters()))
    check(max(norms) <= 1e-12 and diff <= 1e-12,
          f"2 micro-batches per step, clipped to norm 0.5: the norms and the weights after 2 steps equal "
          f"one process's (max |difference| {max(max(norms), diff):.1e} <= 1e-12)",
          difference=max(max(norms), diff), tolerance=1e-12)


def full_checkpoint(mesh, rank):
    # A full state dict, as from torch.save or another library: only rank 0 needs to read it.
    saved = make(seed=7).state_dict()
    model = shard(make(seed=rank), mesh)  # any initial values: the load replaces them
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # (a copy: the load turns the given tensors into DTensors)
    set_model_state_dict(model, copy.deepcopy(saved) if rank == 0 else {}, options=options)
    loaded = difference(full(model), saved)
    # ... and back to a full state dict on rank 0 (on the CPU), ready for torch.save.
    back = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    exact = rank != 0 or (back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved))
    check(loaded == 0 and exact, "a full checkpoint loads into the sharded model from rank 0 alone, "
          "and saves back as a full state dict equal to it (torch.equal)")
    return saved


def meta_init(mesh, rank, saved, device):
    with torch.device("meta"):
        model = Model()
    shard(model, mesh)
    on_meta = all(p.is_meta for p in model.parameters())
    model.to_empty(device=device)  # this rank's shards only, uninitialised
    local = sum(p.to_local().numel() for p in model.parameters())
    set_model_state_dict(model, copy.deepcopy(saved) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    total = sum(p.numel() for p in saved.values())
    check(on_meta and local < total and difference(full(model), saved) == 0,
          f"built on the meta device, sharded, then filled: this rank allocated {local} of {total} "
          "elements and the model equals the checkpoint", allocated=local, elements=total)


def tied_weights(mesh, rank, world):
    model, reference = shard(make(tied=True), mesh), make(tied=True)
    shared = model.out.weight is model.embed.weight
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for ((tokens, targets),) in data(steps=3):
        loss_of(model, tokens[mine], targets[mine]).backward()
        loss_of(reference, tokens, targets).backward()
        for o in (optimizer, reference_optimizer):
            o.step(), o.zero_grad()
    diff = difference(full(model), dict(reference.named_parameters()))
    check(shared and len(list(model.parameters())) == len(list(reference.parameters())) and diff <= 1e-12,
          f"tied weights in the root unit stay one parameter and train as in one process "
          f"(3 Adam steps, max |difference| {diff:.1e} <= 1e-12)", difference=diff, tolerance=1e-12)


def activation_checkpointing(mesh, rank, world):
    tokens, targets = data(steps=1)[0][0]
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {}
    for checkpointed in (False, True):
        model = shard(make(checkpointed=checkpointed), mesh)
        saved = [0]

        def pack(t, saved=saved):  # this pass's counter
            saved[0] += t.numel() * t.element_size()
            return t

        with CommDebugMode() as comms:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_of(model, tokens[mine], targets[mine])
            loss.backward()
        gathers = sum(n for op, n in comms.get_comm_counts().items() if "allgather" in str(op).replace("_", ""))
        results[checkpointed] = (saved[0], gathers, model_grads(model))
    (plain_bytes, plain_gathers, plain_grads), (ac_bytes, ac_gathers, ac_grads) = results[False], results[True]
    if rank == 0:
        print(f"activation checkpointing: {plain_bytes} -> {ac_bytes} bytes saved for backward by rank 0's "
              f"forward; all-gathers per step {plain_gathers} -> {ac_gathers}", flush=True)
    check(difference(ac_grads, plain_grads) <= 1e-12 and ac_bytes < plain_bytes and ac_gathers == plain_gathers,
          "checkpointed blocks give the same gradients (1e-12), save fewer bytes for backward and "
          "all-gather as often", saved_bytes={"plain": plain_bytes, "checkpointed": ac_bytes},
          all_gathers_per_step={"plain": plain_gathers, "checkpointed": ac_gathers})


def model_grads(model):
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


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
    parser = Parser(prog="fsdp2_recipes.py", description=__doc__.splitlines()[0])
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
    use_gpu = device.type == "cuda"
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    global DEVICE
    DEVICE = device
    # Linear on a 3-D input returns a view; this program does no in-place op on outputs.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh(device.type, (world,))
    initial_weights(mesh, rank, world)
    accumulation_and_clipping(mesh, rank, world)
    saved = full_checkpoint(mesh, rank)
    meta_init(mesh, rank, saved, device)
    tied_weights(mesh, rank, world)
    activation_checkpointing(mesh, rank, world)
    if args.report and rank == 0:
        write_report(args.report, {"program": "fsdp2_recipes.py", "world": world, "checks": CHECKS})
    dist.destroy_process_group()
    if not all(c["ok"] for c in CHECKS):
        raise SystemExit(1)


if __name__ == "__main__":
    main(parse_args())
