"""A mixture-of-experts layer with expert parallelism by hand, checked against one process.

Run:  torchrun --standalone --nproc-per-node=2 moe_expert_parallel.py
      torchrun --standalone --nproc-per-node=4 moe_expert_parallel.py --dp 1 2

The layer is a pre-norm block y = x + sum over a token's chosen experts of
gate * expert(norm(x)). A router (a linear layer, then a softmax in float32 or wider)
picks the top k of E small MLP experts for every token (token choice). By default
nothing is dropped: every expert takes every choice it gets, however many (dropless,
as DeepSeek-V3, MegaBlocks and torchtitan train). With --capacity-factor c an expert
takes at most ceil(c * T * k / E) choices of a group of T tokens (one rank's batch), as
in Switch and GShard; the choices past it are dropped, and those tokens keep only the
residual x. The experts run as one grouped matrix multiply (torch._grouped_mm) on their
rows sorted by expert, where the kernel takes the dtype (float32 here); otherwise
(float64) one expert after another.

Balance: the Switch Transformer's auxiliary loss E * sum_e f_e * P_e, with f and P over
the whole batch of every rank (an all-reduce per layer); the router z-loss of ST-MoE, the
mean of logsumexp(logits)^2, which keeps the logits small; and DeepSeek-V3's bias without
a loss: a bias per expert added to the scores only to choose the top k, raised by
--bias-rate after every step for an expert that got fewer choices than the mean, lowered
for one that got more.

Expert parallelism: the ranks form a mesh ("dp", "ep"). The E experts are split
over the ranks of an "ep" row; every rank routes its own tokens, exchanges the
counts with all_to_all_single, sends the tokens to the ranks that hold their
experts with an uneven all_to_all_single, runs its experts, and sends the
outputs back with the inverse exchange. The backward pass goes through the same
exchanges in reverse: `AllToAll` below is written by hand and checked against
torch's own autograd all-to-all. With --dp 2 the experts are replicated over the
two rows (data parallelism on "dp"); the norm and the router are replicated on
every rank.

For every layout given by --dp, dtype by --dtype, top-k by --top-k and capacity
factor by --capacity-factor, every rank also computes the same layer in one piece on
the whole batch (in the same groups, one expert after another) and compares: the
output, the auxiliary loss and the z-loss, which choices were dropped, every gradient,
and the parameters and biases after --steps SGD steps, to TOLERANCE of the dtype
(1e-10 in float64, 1e-6 in float32). The grouped multiply is also checked against the
loop on its own. Then --balance-steps SGD steps of a layer that favours expert 0
(BALANCE) run four ways, without balancing, with the auxiliary loss, with the z-loss
and with the bias; the bias must bring the busiest expert's load to within
BALANCE["within"] times the mean. With --report FILE rank 0 also writes the checks as
JSON ("checks": one per check line, with name, ok and its numbers; "balance": for each
way, the busiest expert's load over the mean load and the z-loss, at every step).

Source: W. Fedus, B. Zoph and N. Shazeer, "Switch Transformers" (2021,
arXiv:2101.03961) for the router, the capacity factor and the auxiliary loss;
D. Lepikhin et al., "GShard" (2020, arXiv:2006.16668) for groups, top-2 and
expert parallelism with all-to-all; B. Zoph et al., "ST-MoE" (2022, arXiv:2202.08906)
for the z-loss; L. Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for
Mixture-of-Experts" (2024, arXiv:2408.15664) and DeepSeek-AI, "DeepSeek-V3 Technical
Report" (2024, arXiv:2412.19437) for the bias; T. Gale et al., "MegaBlocks" (2022,
arXiv:2211.15841) for dropless experts on groups of any size.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

TIMEOUT = datetime.timedelta(seconds=60)
TOLERANCE = {"float64": 1e-10, "float32": 1e-6}  # one process against the ranks, per dtype
PROGRAM = "moe_expert_parallel.py"
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# the balance run: k = 1, expert 0's router bias raised by `skew`; the weights of the two
# losses when they are used; it passes when the last half of the steps' busiest expert
# gets on average at most `within` times the mean load with the bias, and more without
BALANCE = {"skew": 2.0, "aux": 1.0, "z": 0.1, "rate": 0.01, "within": 1.3, "lr": 0.1}


class MoE(nn.Module):
    """The norm and router of every rank, and the experts first .. first + count - 1.

    Expert e is relu(h @ w_in[e]) @ w_out[e]; the experts' weights are stacked so
    that holding some experts is holding some rows of w_in and w_out. ``expert_bias``
    is the balancing bias: it changes which experts a token chooses, not its gates,
    and it is no parameter (no gradient: it moves by `update_bias`).
    """

    def __init__(self, hidden, ffn, experts, first=0, count=None):
        super().__init__()
        self.experts, self.first = experts, first
        count = experts if count is None else count
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts)
        self.w_in = nn.Parameter(torch.randn(count, hidden, ffn) / math.sqrt(hidden))
        self.w_out = nn.Parameter(torch.randn(count, ffn, hidden) / math.sqrt(ffn))
        self.register_buffer("expert_bias", torch.zeros(experts))

    def expert(self, e, h):
        """Expert e (a global number) on the tokens h it was sent."""
        return torch.relu(h @ self.w_in[e - self.first]) @ self.w_out[e - self.first]

    def local_experts(self, rows, counts):
        """Every local expert on its block of ``rows`` (sorted by expert, counts[i] rows for
        local expert i): one grouped multiply per weight where the kernel takes them."""
        if not grouped_mm_takes(rows, self.w_in, self.w_out):
            return torch.cat([self.expert(self.first + i, part)
                              for i, part in enumerate(rows.split(counts))])
        ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        inner = torch.relu(torch._grouped_mm(rows, self.w_in, offs=ends))
        return torch._grouped_mm(inner, self.w_out, offs=ends)


def grouped_mm_takes(*tensors):
    """Whether torch._grouped_mm multiplies these (its refusals on the CPU in torch 2.14.1:
    float64, and strides that are not multiples of 16 bytes)."""
    return hasattr(torch, "_grouped_mm") and all(
        t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in tensors)


def make_layer(hidden, ffn, experts, seed, skew=0.0, first=0, count=None, dtype=torch.float64):
    """The same layer on every rank (same seed); ``skew`` favours expert 0 (a hot expert)."""
    torch.manual_seed(seed)
    whole = MoE(hidden, ffn, experts).to(dtype)
    with torch.no_grad():
        whole.router.bias[0] += skew
    if count is None:
        return whole
    part = MoE(hidden, ffn, experts, first, count).to(dtype)
    part.load_state_dict({**whole.state_dict(), "w_in": whole.w_in[first:first + count],
                          "w_out": whole.w_out[first:first + count]})
    return part


def capacity_of(tokens, experts, k, capacity_factor):
    """The most choices one expert takes from one group of ``tokens`` tokens (None: dropless)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * k / experts)


def router(layer, h):
    """The router's logits and probabilities; the softmax in float32 at least (an fp32
    router: in bfloat16 the probabilities of close experts would round together)."""
    logits = layer.router(h)
    return logits, torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype,
                                                                           torch.float32))


def route(probs, k, capacity=None, bias=None):
    """One group's routing: gate, expert and keep, each (tokens, k).

    ``bias`` (one per expert) is added to the probabilities to choose the top k; the gates
    are the probabilities without it. Without a capacity every choice is kept (dropless).
    With one, the queue of every expert is filled with all first choices in token order,
    then all second choices (GShard's priority); places past ``capacity`` are dropped.
    """
    expert = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
    gate = probs.gather(1, expert)
    if capacity is None:
        return gate, expert, torch.ones_like(expert, dtype=torch.bool)
    choices = F.one_hot(expert.t().reshape(-1), probs.shape[1])  # (k * tokens, E), choice-major
    place = (choices.cumsum(0) * choices).sum(1) - 1             # 0, 1, ... within each expert
    keep = (place < capacity).reshape(k, -1).t()
    return gate, expert, keep


def aux_loss_terms(probs, expert, experts):
    """Per-expert sums of a set of tokens: router probability and number of choices."""
    return probs.sum(0), torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype)


def z_loss_sum(logits):
    """The router z-loss of a set of tokens, summed (ST-MoE takes the mean over tokens)."""
    return torch.logsumexp(logits, dim=-1).square().sum()


def update_bias(layer, load, rate):
    """After a step: raise the bias of an expert below the mean load, lower one above it."""
    with torch.no_grad():
        layer.expert_bias += rate * torch.sign(load.mean() - load)


class Routed(NamedTuple):
    """What the layer gives back: the output, the losses (on a rank, its share: the shares
    add up to the loss), which choices were kept, the choices per expert over the whole
    batch, and the rows each local expert received (expert parallelism only)."""

    y: torch.Tensor
    aux: torch.Tensor
    z: torch.Tensor
    keep: torch.Tensor
    load: torch.Tensor
    received: list | None = None


def reference(layer, x, k, capacity_factor, groups):
    """The whole layer in one process on all the tokens x, cut into ``groups`` groups."""
    experts, (tokens, _) = layer.experts, x.shape
    h = layer.norm(x)
    logits, probs = router(layer, h)
    capacity = capacity_of(tokens // groups, experts, k, capacity_factor)
    routed = [route(p, k, capacity, layer.expert_bias) for p in probs.chunk(groups)]
    gate, expert, keep = (torch.cat(parts) for parts in zip(*routed))
    out = torch.zeros_like(x)
    for e in range(experts):
        token, choice = ((expert == e) & keep).nonzero(as_tuple=True)
        out = out.index_add(0, token, gate[token, choice, None].to(x.dtype) * layer.expert(e, h[token]))
    prob_sum, chosen = aux_loss_terms(probs, expert, experts)
    aux = experts * (chosen / (k * tokens) * prob_sum / tokens).sum()
    return Routed(x + out, aux, z_loss_sum(logits) / tokens, keep, chosen)


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
    """This rank's tokens x through the layer whose experts are spread over ``group``
    (a `Routed`; ``world_tokens``: the tokens of all ranks together)."""
    experts, tokens = layer.experts, x.shape[0]
    ranks = dist.get_world_size(group)
    local = experts // ranks
    h = layer.norm(x)
    logits, probs = router(layer, h)
    gate, expert, keep = route(probs, k, capacity_of(tokens, experts, k, capacity_factor),
                               layer.expert_bias)

    # f of the auxiliary loss, and the bias, need every rank's choices: a sum over all ranks
    prob_sum, chosen = aux_loss_terms(probs, expert, experts)
    dist.all_reduce(chosen)
    aux_share = experts * (chosen / (k * world_tokens) * prob_sum / world_tokens).sum()
    z_share = z_loss_sum(logits) / world_tokens

    # the kept choices, sorted by expert: the experts of rank 0 first, then those of rank 1...
    flat_expert, flat_gate = expert.reshape(-1), gate.reshape(-1).to(x.dtype)
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
    done = layer.local_experts(arrived[order], per_expert)
    back = exchange(done[order.argsort()], in_splits, out_splits, group)

    out = torch.zeros_like(x).index_add(0, sent // k, flat_gate[sent, None] * back)
    return Routed(x + out, aux_share, z_share, keep, chosen, per_expert)


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


def capacity_factor(value):
    """--capacity-factor: a number greater than 0, or dropless (None)."""
    if value == "dropless":
        return None
    try:
        factor = float(value)
    except ValueError:
        factor = math.nan
    if not factor > 0:  # also refuses nan
        fail(f"--capacity-factor {value}: must be greater than 0, or dropless")
    return factor


def parse_args(argv=None):
    """The options, every one checked before a process group exists."""
    parser = Parser(prog=PROGRAM, description="Mixture of experts with expert parallelism.")
    parser.add_argument("--experts", type=int, default=4, help="E, the number of experts")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2], help="experts per token")
    parser.add_argument("--capacity-factor", nargs="+", default=["dropless", "1"],
                        help="capacity = ceil(factor * tokens per rank * k / E), or dropless "
                             "(no capacity)")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--dp", type=int, nargs="+", default=[1],
                        help="data-parallel size of each layout; the expert-parallel size is "
                             "the number of ranks / dp")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="SGD steps of the training check")
    parser.add_argument("--skew", type=float, default=0.0, help="added to expert 0's router bias")
    parser.add_argument("--aux-loss", type=float, default=0.01, help="weight of the auxiliary loss")
    parser.add_argument("--z-loss", type=float, default=0.001, help="weight of the router z-loss")
    parser.add_argument("--bias-rate", type=float, default=0.01,
                        help="step of the balancing bias after every SGD step (0: no bias)")
    parser.add_argument("--balance-steps", type=int, default=60,
                        help="SGD steps of the balance run (0: none)")
    parser.add_argument("--balance-tokens", type=int, default=128,
                        help="tokens per rank in the balance run")
    parser.add_argument("--report", help="also write the checks here, as JSON")
    args = parser.parse_args(argv)
    args.capacity_factor = [capacity_factor(value) for value in args.capacity_factor]
    for k in args.top_k:
        if not 1 <= k <= args.experts:
            fail(f"--top-k {k}: a token chooses between 1 and E = {args.experts} experts")
    for name in ("experts", "tokens", "hidden", "ffn", "steps", "balance_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    for name in ("aux_loss", "z_loss", "bias_rate"):
        if not getattr(args, name) >= 0:  # also refuses nan
            fail(f"--{name.replace('_', '-')} {getattr(args, name):g}: must be 0 or more")
    if args.balance_steps < 0 or args.balance_steps == 1:
        fail(f"--balance-steps {args.balance_steps}: must be 0 (no balance run) or at least 2")
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


def batch(step, world, tokens, hidden, device, dtype=torch.float64):
    """The whole batch of one step (the same on every rank) and its targets."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * tokens, hidden, generator=generator, dtype=torch.float64)
    target = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    return x.to(device, dtype), target.to(device, dtype)


def over_ranks(value, device, op=dist.ReduceOp.SUM):
    """The sum (or maximum) of a number over all ranks."""
    value = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(value, op=op)
    return value.item()


def say(line):
    if dist.get_rank() == 0:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def sum_gradients(layer, dp_group):
    """Replicated weights: their gradients summed, the experts' over dp, the others over all."""
    for name, p in layer.named_parameters():
        dist.all_reduce(p.grad, group=dp_group if name.startswith("w_") else None)


def sgd(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def case_name(dtype, k, factor):
    return f"{dtype}, k={k}, " + ("dropless" if factor is None else f"capacity factor {factor:g}")


def check_case(args, device, mesh, dtype, k, factor, lr=0.1):
    """One layout, dtype, k and capacity factor: this rank's line, rank 0's check lines and
    checks, and whether they passed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    ep, ep_rank = mesh.size(1), mesh.get_local_rank("ep")
    local = args.experts // ep
    first = ep_rank * local
    kind = DTYPES[dtype]
    layer = make_layer(args.hidden, args.ffn, args.experts, 0, args.skew, first, local,
                       kind).to(device)
    whole = make_layer(args.hidden, args.ffn, args.experts, 0, args.skew, dtype=kind).to(device)
    rows = slice(rank * args.tokens, (rank + 1) * args.tokens)
    n = world * args.tokens
    weights = args.aux_loss, args.z_loss
    differences, dropped_same, dropped, received = [], True, 0, None
    for step in range(args.steps):
        x, target = batch(step, world, args.tokens, args.hidden, device, kind)
        mine = expert_parallel(layer, x[rows], k, factor, ep_group, n)
        loss = ((mine.y - target[rows]) ** 2).sum() / mine.y.numel() / world
        (loss + weights[0] * mine.aux + weights[1] * mine.z).backward()
        sum_gradients(layer, dp_group)
        aux, z = mine.aux.detach().clone(), mine.z.detach().clone()
        dist.all_reduce(aux)
        dist.all_reduce(z)

        one = reference(whole, x, k, factor, world)
        (((one.y - target) ** 2).mean() + weights[0] * one.aux + weights[1] * one.z).backward()
        expected = {name: p.grad[first:first + local] if name.startswith("w_") else p.grad
                    for name, p in whole.named_parameters()}
        if step == 0:
            received, dropped = mine.received, int((~mine.keep).sum())
            differences.append(max((mine.y - one.y[rows]).abs().max().item(),
                                   (aux - one.aux).abs().item(), (z - one.z).abs().item(),
                                   *((p.grad - expected[name]).abs().max().item()
                                     for name, p in layer.named_parameters())))
        dropped_same &= bool(torch.equal(mine.keep, one.keep[rows]))
        sgd(layer, lr)
        sgd(whole, lr)
        update_bias(layer, mine.load, args.bias_rate)
        update_bias(whole, one.load, args.bias_rate)
    trained = max((p - (whole.state_dict()[name][first:first + local] if name.startswith("w_")
                        else whole.state_dict()[name])).abs().max().item()
                  for name, p in layer.state_dict().items())
    coordinate = (rank // ep, rank % ep)
    kernel = "one grouped multiply" if grouped_mm_takes(x, layer.w_in) else "one by one"
    line = (f"rank {rank} (dp {coordinate[0]}, ep {coordinate[1]}): experts "
            f"{first}-{first + local - 1} ({kernel}), {case_name(dtype, k, factor)}: received "
            f"{received} tokens per expert, dropped {dropped} of its {args.tokens * k} choices")
    total = int(over_ranks(dropped, device))
    same = over_ranks(int(not dropped_same), device) == 0
    first_step = over_ranks(differences[0], device, dist.ReduceOp.MAX)
    after = over_ranks(trained, device, dist.ReduceOp.MAX)
    capacity = capacity_of(args.tokens, args.experts, k, factor)
    tolerance, name = TOLERANCE[dtype], case_name(dtype, k, factor)
    places = "no capacity" if capacity is None else f"capacity {capacity}"

    def ok(good):
        return "OK" if good else "FAILED"

    lines = [
        f"check: {name} ({places}): step 1 dropped {total} of {n * k} choices; the "
        f"same choices as one process, every step: {ok(same)}",
        f"check: {name}: output, losses and gradients equal one process (aux loss "
        f"{aux.item():.6f}, z-loss {z.item():.6f}; worst {first_step:.1e}): "
        f"{ok(first_step <= tolerance)}",
        f"check: {name}: parameters and biases after {args.steps} SGD steps equal one process "
        f"(worst {after:.1e}): {ok(after <= tolerance)}",
    ]
    case = {"dp": mesh.size(0), "dtype": dtype, "k": k, "capacity_factor": factor,
            "tolerance": tolerance}
    checks = [
        {"name": f"{name} ({places})", "ok": same, **case, "capacity": capacity,
         "dropped": total, "choices": n * k},
        {"name": f"{name}: output, losses and gradients", "ok": first_step <= tolerance, **case,
         "aux_loss": aux.item(), "z_loss": z.item(), "worst": first_step},
        {"name": f"{name}: parameters and biases after {args.steps} SGD steps",
         "ok": after <= tolerance, **case, "worst": after},
    ]
    return line, lines, checks, same and max(first_step, after) <= tolerance


def check_grouped(device, hidden, ffn):
    """torch._grouped_mm against the loop: where `grouped_mm_takes` says it runs it does,
    where it says no the kernel refuses, and where it runs it gives the loop's output and
    gradients (float32; one local expert gets no row). Returns (ok, worst difference)."""
    agrees, worst = True, 0.0
    for kind, width in ((torch.float64, hidden), (torch.float32, hidden), (torch.float32, 3)):
        w = torch.randn(3, width, ffn, dtype=kind, device=device)
        rows = torch.randn(7, width, dtype=kind, device=device)
        try:
            torch._grouped_mm(rows, w, offs=torch.tensor([3, 3, 7], dtype=torch.int32,
                                                        device=device))
            runs = True
        except RuntimeError:
            runs = False
        agrees &= runs == grouped_mm_takes(rows, w)
    layer = MoE(hidden, ffn, 3).to(device, torch.float32)
    rows = torch.randn(7, hidden, device=device, requires_grad=True)
    weights = torch.randn(7, hidden, device=device)
    results = []
    for grouped in (True, False):
        out = (layer.local_experts(rows, [3, 0, 4]) if grouped else
               torch.cat([layer.expert(e, part) for e, part in enumerate(rows.split([3, 0, 4]))]))
        (out * weights).sum().backward()
        results.append([out.detach(), rows.grad, layer.w_in.grad, layer.w_out.grad])
        rows.grad = layer.w_in.grad = layer.w_out.grad = None
    for a, b in zip(*results):
        worst = max(worst, (a - b).abs().max().item())
    agrees &= grouped_mm_takes(rows, layer.w_in, layer.w_out)
    good = over_ranks(int(not agrees or worst > TOLERANCE["float32"]), device) == 0
    return good, over_ranks(worst, device, dist.ReduceOp.MAX)


def balance_run(args, device, mesh, way):
    """--balance-steps SGD steps of the layer with a hot expert (BALANCE), on this rank's
    tokens, balanced ``way`` ("none", "aux", "z" or "bias"): for every step the busiest
    expert's load over the mean and the z-loss, both over the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep, ep_rank = mesh.size(1), mesh.get_local_rank("ep")
    local = args.experts // ep
    layer = make_layer(args.hidden, args.ffn, args.experts, 0, BALANCE["skew"],
                       ep_rank * local, local).to(device)
    tokens, busiest, z_losses = args.balance_tokens, [], []
    rows = slice(rank * tokens, (rank + 1) * tokens)
    aux_weight = BALANCE["aux"] if way == "aux" else 0.0
    z_weight = BALANCE["z"] if way == "z" else 0.0
    for step in range(args.balance_steps):
        x, target = batch(10_000 + step, world, tokens, args.hidden, device)
        mine = expert_parallel(layer, x[rows], 1, None, mesh.get_group("ep"), world * tokens)
        loss = ((mine.y - target[rows]) ** 2).sum() / mine.y.numel() / world
        (loss + aux_weight * mine.aux + z_weight * mine.z).backward()
        sum_gradients(layer, mesh.get_group("dp"))
        sgd(layer, BALANCE["lr"])
        update_bias(layer, mine.load, BALANCE["rate"] if way == "bias" else 0.0)
        busiest.append((mine.load.max() / mine.load.mean()).item())
        z_losses.append(over_ranks(mine.z.item(), device))
    return {"busiest": busiest, "z_loss": z_losses}


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
    every, checks, balance = True, [], {}
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
            for dtype in args.dtype:
                for k in args.top_k:
                    for factor in args.capacity_factor:
                        mine, lines, case_checks, good = check_case(args, device, mesh, dtype,
                                                                    k, factor)
                        checks += case_checks
                        sys.stdout.write(mine + "\n")  # one write: lines of ranks do not mix
                        sys.stdout.flush()
                        dist.barrier()
                        for line in lines:
                            say(line)
                        every &= good
        good, worst = check_grouped(device, args.hidden, args.ffn)
        say(f"check: torch._grouped_mm equals the expert loop, output and gradients (worst "
            f"{worst:.1e}), and runs where grouped_mm_takes says (float32, not float64, not "
            f"rows of 12 bytes): {'OK' if good else 'FAILED'}")
        checks.append({"name": "torch._grouped_mm equals the expert loop", "ok": good,
                       "worst": worst, "tolerance": TOLERANCE["float32"]})
        every &= good
        if args.balance_steps:
            balance = {way: balance_run(args, device, mesh, way)
                       for way in ("none", "aux", "z", "bias")}
            half = args.balance_steps // 2
            late = {way: sum(run["busiest"][half:]) / (args.balance_steps - half)
                    for way, run in balance.items()}
            good = late["bias"] <= BALANCE["within"] < late["none"]
            say(f"check: the bias balances the hot expert: {args.balance_steps} steps, expert "
                f"0's router bias + {BALANCE['skew']:g}; the busiest expert's load over the "
                f"mean, on average over the last {args.balance_steps - half} steps: "
                + ", ".join(f"{way} {value:.2f}" for way, value in late.items())
                + f"; with the bias {BALANCE['within']:g} or less, without balancing more: "
                f"{'OK' if good else 'FAILED'}")
            checks.append({"name": "the bias balances the hot expert", "ok": good,
                           "late_busiest": late, **BALANCE})
            every &= good
        say("all checks passed" if every else "SOME CHECKS FAILED")
        if args.report and rank == 0:
            write_report(args.report, {"program": PROGRAM, "world": world, "checks": checks,
                                       "balance": balance})
    finally:
        dist.destroy_process_group()
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
