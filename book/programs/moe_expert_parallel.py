"""A mixture-of-experts layer with expert parallelism by hand, checked against one process.

Run:  torchrun --standalone --nproc-per-node=2 moe_expert_parallel.py
      torchrun --standalone --nproc-per-node=4 moe_expert_parallel.py --dp 1 2

The layer is a pre-norm block y = x + sum over a token's chosen experts of
gate * expert(norm(x)). A router (linear + softmax) picks the top k of E small
MLP experts for every token. Each expert takes at most `capacity` tokens of a
group (a group is one rank's batch of tokens); the choices that overflow are
dropped, and those tokens keep only the residual x. The Switch Transformer's
auxiliary loss E * sum_e f_e * P_e pushes the router towards balance.

Expert parallelism: the ranks form a mesh ("dp", "ep"). The E experts are split
over the ranks of an "ep" row; every rank routes its own tokens, exchanges the
counts with all_to_all_single, sends the tokens to the ranks that hold their
experts with an uneven all_to_all_single, runs its experts, and sends the
outputs back with the inverse exchange. The backward pass goes through the same
exchanges in reverse: `AllToAll` below is written by hand and checked against
torch's own autograd all-to-all. With --dp 2 the experts are replicated over the
two rows (data parallelism on "dp"); the norm and the router are replicated on
every rank.

For every layout given by --dp, top-k given by --top-k and capacity factor given
by --capacity-factor, every rank also computes the same layer in one piece on the
whole batch (in the same groups) and compares, in float64: the output, the
auxiliary loss, which choices were dropped, every gradient, and the parameters
after --steps SGD steps. With --report FILE rank 0 also writes the checks as JSON
("checks": one per check line, with name, ok, dp, k, capacity_factor and its numbers:
dropped and choices, or worst).

Source: W. Fedus, B. Zoph and N. Shazeer, "Switch Transformers" (2021,
arXiv:2101.03961) for the router, the capacity factor and the auxiliary loss;
D. Lepikhin et al., "GShard" (2020, arXiv:2006.16668) for groups, top-2 and
expert parallelism with all-to-all.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

TIMEOUT = datetime.timedelta(seconds=60)
TOLERANCE = 1e-10
PROGRAM = "moe_expert_parallel.py"


class MoE(nn.Module):
    """The norm and router of every rank, and the experts first .. first + count - 1.

    Expert e is relu(h @ w_in[e]) @ w_out[e]; the experts' weights are stacked so
    that holding some experts is holding some rows of w_in and w_out.
    """

    def __init__(self, hidden, ffn, experts, first=0, count=None):
        super().__init__()
        self.experts, self.first = experts, first
        count = experts if count is None else count
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts)
        self.w_in = nn.Parameter(torch.randn(count, hidden, ffn) / math.sqrt(hidden))
        self.w_out = nn.Parameter(torch.randn(count, ffn, hidden) / math.sqrt(ffn))

    def expert(self, e, h):
        """Expert e (a global number) on the tokens h it was sent."""
        return torch.relu(h @ self.w_in[e - self.first]) @ self.w_out[e - self.first]


def make_layer(hidden, ffn, experts, seed, skew=0.0, first=0, count=None):
    """The same layer on every rank (same seed); ``skew`` favours expert 0 (a hot expert)."""
    torch.manual_seed(seed)
    whole = MoE(hidden, ffn, experts).double()
    with torch.no_grad():
        whole.router.bias[0] += skew
    if count is None:
        return whole
    part = MoE(hidden, ffn, experts, first, count).double()
    part.load_state_dict({**whole.state_dict(), "w_in": whole.w_in[first:first + count],
                          "w_out": whole.w_out[first:first + count]})
    return part


def capacity_of(tokens, experts, k, capacity_factor):
    """The most choices one expert takes from one group of ``tokens`` tokens."""
    return math.ceil(capacity_factor * tokens * k / experts)


def route(probs, k, capacity):
    """One group's routing: gate, expert and keep, each (tokens, k).

    The queue of every expert is filled with all first choices in token order,
    then all second choices (GShard's priority); places past ``capacity`` are dropped.
    """
    gate, expert = probs.topk(k, dim=-1)
    choices = F.one_hot(expert.t().reshape(-1), probs.shape[1])  # (k * tokens, E), choice-major
    place = (choices.cumsum(0) * choices).sum(1) - 1             # 0, 1, ... within each expert
    keep = (place < capacity).reshape(k, -1).t()
    return gate, expert, keep


def aux_loss_terms(probs, expert, experts):
    """Per-expert sums of a set of tokens: router probability and number of choices."""
    return probs.sum(0), torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype)


def reference(layer, x, k, capacity_factor, groups):
    """The whole layer in one process on all the tokens x, cut into ``groups`` groups."""
    experts, (tokens, _) = layer.experts, x.shape
    h = layer.norm(x)
    probs = torch.softmax(layer.router(h), dim=-1)
    capacity = capacity_of(tokens // groups, experts, k, capacity_factor)
    routed = [route(p, k, capacity) for p in probs.chunk(groups)]
    gate, expert, keep = (torch.cat(parts) for parts in zip(*routed))
    out = torch.zeros_like(x)
    for e in range(experts):
        token, choice = ((expert == e) & keep).nonzero(as_tuple=True)
        out = out.index_add(0, token, gate[token, choice, None] * layer.expert(e, h[token]))
    prob_sum, chosen = aux_loss_terms(probs, expert, experts)
    aux = experts * (chosen / (k * tokens) * prob_sum / tokens).sum()
    return x + out, aux, keep


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, differentiable: the backward pass sends
    each gradient row back where its row came from (the same exchange, splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def by_torch(x, out_splits, in_splits, group):
    """The same exchange with torch's own differentiable all-to-all."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, out_splits, in_splits, group))


def expert_parallel(layer, x, k, capacity_factor, group, world_tokens, exchange=AllToAll.apply):
    """This rank's tokens x through the layer whose experts are spread over ``group``.

    Returns the output, this rank's share of the auxiliary loss (the shares add up
    to the loss), keep (which choices were not dropped) and the tokens each local
    expert received.
    """
    experts, tokens = layer.experts, x.shape[0]
    ranks = dist.get_world_size(group)
    local = experts // ranks
    h = layer.norm(x)
    probs = torch.softmax(layer.router(h), dim=-1)
    gate, expert, keep = route(probs, k, capacity_of(tokens, experts, k, capacity_factor))

    # the auxiliary loss needs every rank's choices: a sum over all ranks (no gradient)
    prob_sum, chosen = aux_loss_terms(probs, expert, experts)
    dist.all_reduce(chosen)
    aux_share = experts * (chosen / (k * world_tokens) * prob_sum / world_tokens).sum()

    # the kept choices, sorted by expert: the experts of rank 0 first, then those of rank 1...
    flat_expert, flat_gate = expert.reshape(-1), gate.reshape(-1)
    sent = keep.reshape(-1).nonzero().squeeze(1)
    sent = sent[flat_expert[sent].argsort(stable=True)]
    counts = torch.bincount(flat_expert[sent], minlength=experts)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # (source rank, local expert)
    in_splits = counts.view(ranks, local).sum(1).tolist()
    out_splits = received_counts.view(ranks, local).sum(1).tolist()

    arrived = exchange(h[sent // k], out_splits, in_splits, group)  # by source, then expert
    label = torch.arange(local, device=x.device).repeat(ranks).repeat_interleave(
        received_counts)
    order = label.argsort(stable=True)
    per_expert = received_counts.view(ranks, local).sum(0).tolist()
    done = torch.cat([layer.expert(layer.first + e, rows)
                      for e, rows in enumerate(arrived[order].split(per_expert))])
    back = exchange(done[order.argsort()], in_splits, out_splits, group)

    out = torch.zeros_like(x).index_add(0, sent // k, flat_gate[sent, None] * back)
    return x + out, aux_share, keep, per_expert


def fail(message):
    """One line on stderr (from rank 0 under torchrun), exit status 2, nothing started."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(message + "\n")
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every worker as soon as one exits: let rank 0 say why first
        # (its exit ends this wait)
        time.sleep(10)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(f"{self.prog}: {message}")


def parse_args(argv=None):
    """The options, every one checked before a process group exists."""
    parser = Parser(prog=PROGRAM, description="Mixture of experts with expert parallelism.")
    parser.add_argument("--experts", type=int, default=4, help="E, the number of experts")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2], help="experts per token")
    parser.add_argument("--capacity-factor", type=float, nargs="+", default=[1.0, 4.0],
                        help="capacity = ceil(factor * tokens per rank * k / E)")
    parser.add_argument("--dp", type=int, nargs="+", default=[1],
                        help="data-parallel size of each layout; the expert-parallel size is "
                             "the number of ranks / dp")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="SGD steps of the training check")
    parser.add_argument("--skew", type=float, default=0.0, help="added to expert 0's router bias")
    parser.add_argument("--report", help="also write the checks here, as JSON")
    args = parser.parse_args(argv)
    for k in args.top_k:
        if not 1 <= k <= args.experts:
            fail(f"--top-k {k}: a token chooses between 1 and E = {args.experts} experts")
    for factor in args.capacity_factor:
        if not factor > 0:  # also refuses nan
            fail(f"--capacity-factor {factor:g}: must be greater than 0")
    for name in ("experts", "tokens", "hidden", "ffn", "steps"):
        if getattr(args, name) < 1:
            fail(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        fail(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if "WORLD_SIZE" not in os.environ:
        fail(f"start it with torchrun: torchrun --standalone --nproc-per-node=2 {PROGRAM}")
    world = int(os.environ["WORLD_SIZE"])
    for dp in args.dp:
        if dp < 1 or world % dp:
            fail(f"--dp {dp}: the {world} ranks do not split into {dp} data-parallel rows")
        if args.experts % (world // dp):
            fail(f"--experts {args.experts}: {args.experts} experts do not split evenly over "
                 f"an expert-parallel size of {world // dp} ({world} ranks, --dp {dp})")
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
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return device.type


def mesh_of(device, dp, ep):
    """The ("dp", "ep") mesh; its groups get the same timeout as the default group."""
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
    else:
        options = dist.ProcessGroupGloo.Options("gloo", TIMEOUT)
    return init_device_mesh(device, (dp, ep), mesh_dim_names=("dp", "ep"),
                            backend_override={"dp": options, "ep": options})


def batch(step, world, tokens, hidden, device):
    """The whole batch of one step (the same on every rank) and its targets."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * tokens, hidden, generator=generator, dtype=torch.float64)
    return x.to(device), torch.randn(x.shape, generator=generator, dtype=x.dtype).to(device)


def over_ranks(value, device, op=dist.ReduceOp.SUM):
    """The sum (or maximum) of a number over all ranks."""
    value = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(value, op=op)
    return value.item()


def say(line):
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def check_case(args, device, mesh, k, factor, aux_weight=0.01, lr=0.1):
    """One layout, k and capacity factor: this rank's line, rank 0's check lines and checks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    ep, ep_rank = mesh.size(1), mesh.get_local_rank("ep")
    local = args.experts // ep
    first = ep_rank * local
    layer = make_layer(args.hidden, args.ffn, args.experts, 0, args.skew, first, local).to(device)
    whole = make_layer(args.hidden, args.ffn, args.experts, 0, args.skew).to(device)
    rows = slice(rank * args.tokens, (rank + 1) * args.tokens)
    n = world * args.tokens
    differences, dropped_same, dropped, received = [], True, 0, None
    for step in range(args.steps):
        x, target = batch(step, world, args.tokens, args.hidden, device)
        y, aux_share, keep, per_expert = expert_parallel(layer, x[rows], k, factor, ep_group, n)
        loss = ((y - target[rows]) ** 2).sum() / y.numel() / world + aux_weight * aux_share
        loss.backward()
        for name, p in layer.named_parameters():  # replicated: sum the gradients
            dist.all_reduce(p.grad, group=dp_group if name.startswith("w_") else None)
        aux = aux_share.detach().clone()
        dist.all_reduce(aux)

        y_all, aux_all, keep_all = reference(whole, x, k, factor, world)
        (((y_all - target) ** 2).mean() + aux_weight * aux_all).backward()
        expected = {name: p.grad[first:first + local] if name.startswith("w_") else p.grad
                    for name, p in whole.named_parameters()}
        if step == 0:
            received = per_expert
            dropped = int((~keep).sum())
            differences.append(max((y - y_all[rows]).abs().max().item(),
                                   (aux - aux_all).abs().item(),
                                   *((p.grad - expected[name]).abs().max().item()
                                     for name, p in layer.named_parameters())))
        dropped_same &= bool(torch.equal(keep, keep_all[rows]))
        with torch.no_grad():
            for model in (layer, whole):
                for p in model.parameters():
                    p -= lr * p.grad
                    p.grad = None
    trained = max((p - (whole.state_dict()[name][first:first + local] if name.startswith("w_")
                        else whole.state_dict()[name])).abs().max().item()
                  for name, p in layer.state_dict().items())
    coordinate = (rank // ep, rank % ep)
    mine = (f"rank {rank} (dp {coordinate[0]}, ep {coordinate[1]}): experts "
            f"{first}-{first + local - 1}, k={k}, capacity factor {factor:g}: received "
            f"{received} tokens per expert, dropped {dropped} of its {args.tokens * k} choices")
    total = int(over_ranks(dropped, device))
    same = over_ranks(int(not dropped_same), device) == 0
    first_step = over_ranks(differences[0], device, dist.ReduceOp.MAX)
    after = over_ranks(trained, device, dist.ReduceOp.MAX)
    capacity = capacity_of(args.tokens, args.experts, k, factor)
    def ok(good):
        return "OK" if good else "FAILED"

    lines = [
        f"check: k={k}, capacity factor {factor:g} (capacity {capacity}): step 1 dropped "
        f"{total} of {n * k} choices; the same choices as one process, every step: {ok(same)}",
        f"check: k={k}, capacity factor {factor:g}: output, aux loss {aux.item():.6f} and "
        f"every gradient equal one process (worst {first_step:.1e}): {ok(first_step <= TOLERANCE)}",
        f"check: k={k}, capacity factor {factor:g}: parameters after {args.steps} SGD steps "
        f"equal one process (worst {after:.1e}): {ok(after <= TOLERANCE)}",
    ]
    case = {"dp": mesh.size(0), "k": k, "capacity_factor": factor}
    checks = [
        {"name": f"k={k}, capacity factor {factor:g} (capacity {capacity})", "ok": same, **case,
         "capacity": capacity, "dropped": total, "choices": n * k},
        {"name": f"k={k}, capacity factor {factor:g}: output, aux loss", "ok": first_step <= TOLERANCE,
         **case, "aux_loss": aux.item(), "worst": first_step},
        {"name": f"k={k}, capacity factor {factor:g}: parameters after {args.steps} SGD steps",
         "ok": after <= TOLERANCE, **case, "worst": after},
    ]
    return mine, lines, checks, same and max(first_step, after) <= TOLERANCE


def check_exchange(device, group, hidden):
    """The hand-written AllToAll against torch's differentiable all-to-all: same rows, same
    gradients, with splits that differ from rank to rank."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    in_splits = [(rank + 2 * peer) % 3 for peer in range(ranks)]
    out_splits = [(peer + 2 * rank) % 3 for peer in range(ranks)]
    base = torch.randn(sum(in_splits), hidden, dtype=torch.float64, device=device).requires_grad_()
    weights = torch.randn(sum(out_splits), hidden, dtype=torch.float64, device=device)
    results = []
    for exchange in (AllToAll.apply, by_torch):
        base.grad = None
        out = exchange(base * 1.0, out_splits, in_splits, group)
        (out * weights).sum().backward()
        results.append((out.detach(), base.grad.clone()))
    (out_a, grad_a), (out_b, grad_b) = results
    differ = not (torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b))
    return over_ranks(differ, device) == 0


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main():
    args = parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    every, checks = True, []
    try:
        for dp in args.dp:
            ep = world // dp
            mesh = mesh_of(device, dp, ep)
            say(f"== mesh {mesh.mesh.tolist()} dims ('dp', 'ep'): {args.experts} experts over "
                f"ep {ep}, {args.experts // ep} per rank, replicated over dp {dp}; "
                f"{args.tokens} tokens per rank")
            same = check_exchange(device, mesh.get_group("ep"), args.hidden)
            say(f"check: AllToAll (by hand) equals torch's all_to_all_single_autograd, rows and "
                f"gradients, uneven splits: {'OK' if same else 'FAILED'}")
            checks.append({"name": "AllToAll (by hand) equals torch's all_to_all_single_autograd",
                           "ok": bool(same), "dp": dp})
            every &= same
            for k in args.top_k:
                for factor in args.capacity_factor:
                    mine, lines, case_checks, good = check_case(args, device, mesh, k, factor)
                    checks += case_checks
                    sys.stdout.write(mine + "\n")  # one write: lines of ranks do not mix
                    sys.stdout.flush()
                    dist.barrier()
                    for line in lines:
                        say(line)
                    every &= good
        say("all checks passed" if every else "SOME CHECKS FAILED")
        if args.report and rank == 0:
            write_report(args.report, {"program": PROGRAM, "world": world, "checks": checks})
    finally:
        dist.destroy_process_group()
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
