"""The source's linear regression as SBP on DTensor, boxing by hand, and a tensor-parallel layer.

Run:  torchrun --standalone --nproc-per-node=4 dtensor_regression.py

1. Data parallelism is an SBP choice: the samples x, y are S(0) (one per rank), the
   weight w is B, the loss is the sum of squared errors over the *global* batch. The
   gradient comes out P and optimizer.step() turns it into B with an all-reduce.
   500 SGD steps at lr 0.01 from w = [0, 0] reach y = 2 x1 + 3 x2, as one process does.
2. Boxing by hand: S(0) -> B is an all-gather, P -> B an all-reduce, P -> S(0) a
   reduce-scatter, S(0) -> S(1) an all-to-all, each with plain torch.distributed on the
   mesh's group and compared with DTensor's redistribute (an even split; uneven pieces
   would need padding to equal sizes first).
3. Tensor parallelism: ColwiseParallel then RowwiseParallel on Linear-ReLU-Linear; the
   only collective of the forward pass is one P -> B all-reduce.

Every rank checks its results; rank 0 prints. Source: the OneFlow book's data-parallel
example (source article), PyTorch's DTensor and tensor-parallel APIs.
"""

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

SEED_X = [[1.0, 2.0], [2.0, 3.0], [4.0, 6.0], [3.0, 1.0]]
SEED_Y = [[8.0], [13.0], [26.0], [9.0]]  # y = 2 x1 + 3 x2


def counts(mode):
    """The collectives a CommDebugMode saw: {'all_reduce': 1, ...}."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def regression(mesh, iters=500, lr=0.01):
    """Train w (B) on samples (S(0)) with a global sum loss, and one process beside it."""
    x_all, y_all = torch.tensor(SEED_X), torch.tensor(SEED_Y)
    x, y = distribute_tensor(x_all, mesh, [Shard(0)]), distribute_tensor(y_all, mesh, [Shard(0)])
    w = nn.Parameter(distribute_tensor(torch.zeros(2, 1), mesh, [Replicate()]))
    optimizer = torch.optim.SGD([w], lr=lr)
    w_ref = torch.zeros(2, 1, requires_grad=True)  # one process, full batch
    optimizer_ref = torch.optim.SGD([w_ref], lr=lr)
    losses, first = [], {}
    for step in range(iters):
        watch = CommDebugMode if step == 0 else contextlib.nullcontext  # the first step only
        optimizer.zero_grad()
        with watch() as forward_backward:
            loss = ((x @ w - y) ** 2).sum()  # S(0) x B = S(0); its sum is P
            loss.backward()
        if step == 0:
            first = {"pred": (x @ w).placements, "loss": loss.placements, "grad": w.grad.placements,
                     "grad_local": w.grad.to_local().detach().clone(),
                     "forward_backward": counts(forward_backward)}
        with watch() as update:
            optimizer.step()  # a B parameter with a P gradient: P -> B first
        if step == 0:
            first["step"] = counts(update)
        optimizer_ref.zero_grad()
        ((x_all @ w_ref - y_all) ** 2).sum().backward()
        optimizer_ref.step()
        if (step + 1) % 50 == 0:
            losses.append((step + 1, loss.detach().full_tensor().item()))
    return {"w": w, "w_ref": w_ref.detach(), "losses": losses, **first}


def boxing_by_hand(mesh):
    """Each rule done with a collective on the mesh's group, and DTensor's result beside it."""
    group, n, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    # Small integers, so that sums in any order are exact and the results can be torch.equal.
    full = torch.randint(-9, 10, (n * 2, n * 2), generator=torch.Generator().manual_seed(0)).float()
    summand = torch.randint(-9, 10, (n * 2, n * 2), generator=torch.Generator().manual_seed(rank)).float()
    results = {}

    pieces = [torch.empty(2, n * 2) for _ in range(n)]  # S(0) -> B: all-gather, concatenate
    dist.all_gather(pieces, full.chunk(n)[rank].contiguous(), group=group)
    theirs = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    results["S(0) -> B: all_gather"] = torch.equal(torch.cat(pieces), theirs.to_local())

    total = summand.clone()  # P -> B: all-reduce the summands
    dist.all_reduce(total, group=group)
    partial = torch.distributed.tensor.DTensor.from_local(summand, mesh, [Partial()])
    results["P -> B: all_reduce"] = torch.equal(total, partial.redistribute(mesh, [Replicate()]).to_local())

    mine = torch.empty(2, n * 2)  # P -> S(0): reduce-scatter, each rank keeps its rows
    dist.reduce_scatter(mine, list(summand.chunk(n)), group=group)
    results["P -> S(0): reduce_scatter"] = torch.equal(mine, partial.redistribute(mesh, [Shard(0)]).to_local())

    # S(0) -> S(1): rank r sends peer p the columns of p from its rows (an all-to-all)
    rows = full.chunk(n)[rank]
    received = [torch.empty(2, 2) for _ in range(n)]
    dist.all_to_all(received, [c.contiguous() for c in rows.chunk(n, dim=1)], group=group)
    theirs = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    results["S(0) -> S(1): all_to_all"] = torch.equal(torch.cat(received), theirs.to_local())
    return results


def tensor_parallel(mesh, seed=0, batch=4):
    """Linear-ReLU-Linear: ColwiseParallel, then RowwiseParallel, against the plain module."""
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    tp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    tp.load_state_dict(plain.state_dict())
    x = torch.randn(batch, 8)
    plain(x).pow(2).sum().backward()
    tp = parallelize_module(tp.to(mesh.device_type), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with CommDebugMode() as forward:
        out = tp(x.to(mesh.device_type))  # layer 0: weight S(0), output S(1); layer 2: weight S(1), output P -> B
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()
    return {"tp": tp, "plain": plain, "out": out.detach().cpu(), "expected": plain(x).detach(),
            "forward": counts(forward), "backward": counts(backward)}


def main():
    # A CPU program: DTensor's CPU mesh and gloo (the SBP chapter's four processes fit anywhere).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    say = print if rank == 0 else (lambda *a, **k: None)
    ok = True

    reg = regression(mesh)
    for step, loss in reg["losses"]:
        say(f"{step}/500 loss:{loss:.3e}")
    w = reg["w"].full_tensor()
    say(f"w = {w.flatten().tolist()} on every rank, SBP {reg['w'].placements}")
    say(f"prediction {reg['pred']}, loss {reg['loss']}, gradient {reg['grad']}")
    say(f"collectives: forward + backward {reg['forward_backward'] or 'none'}, optimizer.step() {reg['step']}")
    ok &= (w.flatten() - torch.tensor([2.0, 3.0])).abs().max().item() < 1e-5
    ok &= (w - reg["w_ref"]).abs().max().item() < 1e-6

    for rule, same in boxing_by_hand(mesh).items():
        say(f"by hand {rule:28s} equals DTensor's redistribute: {same}")
        ok &= same

    tp = tensor_parallel(mesh)
    for name, p in tp["tp"].named_parameters():
        say(f"{name:9s} placements {p.placements}, local shape {tuple(p.to_local().shape)}")
    say(f"collectives: forward {tp['forward']}, backward {tp['backward'] or 'none'}")
    grads = {n: p.grad for n, p in tp["plain"].named_parameters()}
    worst = max((p.grad.full_tensor() - grads[n]).abs().max().item() for n, p in tp["tp"].named_parameters())
    ok &= (tp["out"] - tp["expected"]).abs().max().item() < 1e-6 and worst < 1e-6

    checks = torch.tensor(float(ok))
    dist.all_reduce(checks, op=dist.ReduceOp.MIN)  # every rank's checks
    say(f"check {'passed' if checks.item() else 'FAILED'}: w reaches [2, 3] (1e-5) and one process's w (1e-6) "
        "on every rank, the hand-written boxing equals DTensor's, the tensor-parallel layer equals the "
        "plain one (1e-6)")
    dist.destroy_process_group()
    if not checks.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
