"""Context parallelism: ring attention by hand, zig-zag and Ulysses, against full attention.

The sequence is split over the ranks (S(1) for q, k and v of shape batch, heads, sequence,
head dim, sharded on dimension 2 of the tensor). Each variant is checked in float64 against
full attention on the whole sequence in one process: the output and the gradients of q, k, v.

  ring     each rank keeps its queries; the key/value blocks travel around the ring
           (batch_isend_irecv), the next block's transfer posted before the compute on the
           current one, and every block is folded into a running softmax (max and sum).
           The backward is written by hand: the same ring again, with the log-sum-exp saved
           by the forward, and the key/value gradients travelling with their block. The
           running values and the travelling gradients are float32 at least
           (accumulator_dtype), so bfloat16 inputs are rounded once, at the end.
  zigzag   the same ring on the head-tail split: rank i holds chunks i and 2N-1-i of 2N, so
           that under the causal mask every rank does the same work.
  ulysses  one all_to_all turns the sequence split into a split of the heads, each rank runs
           full attention for its heads on the whole sequence, and a second one turns it back.

Run:  torchrun --standalone --nproc-per-node=2 ring_attention.py
      torchrun --standalone --nproc-per-node=3 ring_attention.py --seq 36 --heads 6

With --report FILE rank 0 also writes what it printed as JSON: "checks" (one per check line:
name, method, causal, ok, the worst differences), "work" (causal work per rank, ring and
zigzag) and "bytes" (bytes sent per rank, forward + backward, causal), by method.

Source: ring attention (Liu et al.), the zig-zag split of ring-flash-attention and
DeepSpeed-Ulysses; written afresh for this book.
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

TOLERANCE = 1e-10
METHODS = ("ring", "zigzag", "ulysses")
SENT = {"bytes": 0}  # bytes this rank sends to other ranks
WORK = {"blocks": 0.0}  # block products this rank computes, in (S/N) x (S/N) blocks


def chunks_of(rank, world, split):
    """The chunks of the sequence a rank holds: N chunks (contiguous) or 2N (head-tail)."""
    return [rank] if split == "contiguous" else [rank, 2 * world - 1 - rank]


def block_pairs(q_chunks, k_chunks, causal):
    """(query chunk, key chunk, on the diagonal) for every product the causal mask leaves."""
    return [(i, j, causal and a == b) for i, a in enumerate(q_chunks)
            for j, b in enumerate(k_chunks) if not causal or a >= b]


def ring_pass(tensors, tag):
    """Start sending tensors to the next rank and receiving the same shapes from the previous."""
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world, tag=tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world, tag=tag) for t in incoming]
    SENT["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
    return incoming, dist.batch_isend_irecv(ops)


def wait(requests):
    for request in requests:
        request.wait()


def scores(q, k, diagonal):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:  # the same chunk on both sides: a query sees only the keys up to itself
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def accumulator_dtype(dtype):
    """float32 at least: in bfloat16 every merge and every hop would round the running values."""
    return torch.promote_types(dtype, torch.float32)


def merge_block(q, k, v, diagonal, m, total, acc):
    """Fold one block of keys and values into the running softmax of q (m, total, acc in place).

    The block's arithmetic runs in the running values' dtype (float32 for bfloat16 inputs)."""
    q, k, v = (t.to(m.dtype) for t in (q, k, v))
    s = scores(q, k, diagonal)
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new.unsqueeze(-1))
    correction = torch.exp(m - m_new)  # what the old max was worth against the new one
    total.mul_(correction).add_(p.sum(-1))
    acc.mul_(correction.unsqueeze(-1)).add_(p @ v)
    m.copy_(m_new)


def grad_block(q, k, v, dout, lse, delta, diagonal):
    """One block's share of dq, dk, dv, from the probabilities rebuilt with the saved lse
    (in lse's dtype: float32 for bfloat16 inputs)."""
    q, k, v, dout = (t.to(lse.dtype) for t in (q, k, v, dout))
    p = torch.exp(scores(q, k, diagonal) - lse.unsqueeze(-1))
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1)) / math.sqrt(q.shape[-1])
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def ring_forward(q, k, v, split, causal):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = chunks_of(rank, world, split)
    c = q.shape[2] // len(mine)  # positions per chunk
    m = torch.full(q.shape[:3], float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)
    total, acc = torch.zeros_like(m), torch.zeros_like(q, dtype=m.dtype)
    held = (k, v)
    for step in range(world):
        if step < world - 1:
            incoming, requests = ring_pass(held, tag=0)  # the next block moves while we compute
        theirs = chunks_of((rank - step) % world, world, split)
        for i, j, diagonal in block_pairs(mine, theirs, causal):
            rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
            merge_block(q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols], diagonal,
                        m[..., rows], total[..., rows], acc[:, :, rows])
            WORK["blocks"] += (0.5 if diagonal else 1.0) * (c / q.shape[2]) ** 2
        if step < world - 1:
            wait(requests)
            held = tuple(incoming)
    return (acc / total.unsqueeze(-1)).to(q.dtype), m + total.log()  # lse stays in m's dtype


def ring_backward(q, k, v, out, lse, dout, split, causal):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = chunks_of(rank, world, split)
    c = q.shape[2] // len(mine)
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    dq = torch.zeros_like(q, dtype=lse.dtype)  # the sums in float32 at least, like the forward's
    held, grads_in, grad_requests = (k, v), None, []
    for step in range(world):
        if step < world - 1:
            incoming, requests = ring_pass(held, tag=0)
        # this rank's share for the held block, in lse's dtype: no hop rounds it to bfloat16
        dk, dv = (torch.zeros_like(t, dtype=lse.dtype) for t in (k, v))
        theirs = chunks_of((rank - step) % world, world, split)
        for i, j, diagonal in block_pairs(mine, theirs, causal):
            rows, cols = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
            dq_part, dk_part, dv_part = grad_block(
                q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols], dout[:, :, rows],
                lse[..., rows], delta[..., rows], diagonal)
            dq[:, :, rows] += dq_part
            dk[:, :, cols] += dk_part
            dv[:, :, cols] += dv_part
        if step > 0:  # the shares of the ranks this block visited before
            wait(grad_requests)
            dk, dv = dk + grads_in[0], dv + grads_in[1]
        grads_in, grad_requests = ring_pass((dk, dv), tag=1)  # the gradients follow the block
        if step < world - 1:
            wait(requests)
            held = tuple(incoming)
    wait(grad_requests)  # after N hops a block's gradient is back on the rank that owns it
    return dq.to(q.dtype), grads_in[0].to(k.dtype), grads_in[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Forward and backward by hand: autograd through the loop would keep every block it saw."""

    @staticmethod
    def forward(ctx, q, k, v, split, causal):
        out, lse = ring_forward(q, k, v, split, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.causal = split, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(*ctx.saved_tensors, dout.contiguous(), ctx.split, ctx.causal)
        return dq, dk, dv, None, None


def all_to_all(x, scatter_dim, gather_dim):
    """Cut x in N pieces along scatter_dim, piece j to rank j; join what arrives on gather_dim."""
    world = dist.get_world_size()
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    SENT["bytes"] += send.numel() * send.element_size() * (world - 1) // world
    return torch.cat(recv.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """S(scatter_dim) -> S(gather_dim); its backward is the all_to_all the other way."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim):
        ctx.dims = scatter_dim, gather_dim
        return all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.dims[1], ctx.dims[0]), None, None


def ulysses_attention(q, k, v, causal):
    """(batch, heads, S/N, dim) per rank -> (batch, heads/N, S, dim): full attention -> back."""
    q, k, v = (AllToAll.apply(t, 1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return AllToAll.apply(out, 2, 1)


def positions(rank, world, seq, split):
    """The global positions a rank holds, in the order it holds them."""
    chunk = seq // (world if split == "contiguous" else 2 * world)
    return torch.cat([torch.arange(a * chunk, (a + 1) * chunk)
                      for a in chunks_of(rank, world, split)])


def check_variant(method, causal, full, args):
    """Run one variant on this rank's part; the worst difference from full attention, all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    split = "zigzag" if method == "zigzag" else "contiguous"
    mine = positions(rank, world, args.seq, split)
    q, k, v, dout = (t[:, :, mine].clone().requires_grad_(i < 3)
                     for i, t in enumerate(full["inputs"]))
    SENT["bytes"], WORK["blocks"] = 0, 0.0
    if method == "ulysses":
        out = ulysses_attention(q, k, v, causal)
    else:
        out = RingAttention.apply(q, k, v, split, causal)
    out.backward(dout)
    expected = full[causal]
    worst = torch.tensor([(mine_t - whole[:, :, mine]).abs().max().item() for mine_t, whole in
                          zip((out, q.grad, k.grad, v.grad), expected)],
                         dtype=torch.float64, device=q.device)  # collectives take device tensors
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    counts = torch.tensor([WORK["blocks"], SENT["bytes"]], dtype=torch.float64, device=q.device)
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts)
    return worst.tolist(), [g.tolist() for g in gathered]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (from rank 0 only) and exit status 2
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)


def parse_args(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=48, help="sequence length (all ranks)")
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--methods", default=",".join(METHODS), help="any of ring,zigzag,ulysses")
    parser.add_argument("--report", help="also write the checks and the counts here, as JSON")
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    # Checked before any process group exists: one line, exit status 2.
    world = int(os.environ.get("WORLD_SIZE", "0"))
    for name in ("batch", "heads", "seq", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {','.join(args.methods)}: unknown {unknown[0]!r} "
                     f"(choose from {', '.join(METHODS)})")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if "WORLD_SIZE" not in os.environ:
        parser.error("start it with torchrun: "
                     "torchrun --standalone --nproc-per-node=2 ring_attention.py")
    if world < 2:
        parser.error(f"--nproc-per-node={world}: context parallelism splits the sequence over "
                     "2 ranks or more (use --nproc-per-node=2)")
    pieces = 2 * world if "zigzag" in args.methods else world
    if args.seq % pieces:
        how = (f"the zig-zag split cuts it into 2 x {world} = {pieces} chunks" if pieces > world
               else f"it is split into {world} blocks")
        parser.error(f"--seq {args.seq}: {how}, and {args.seq} does not divide evenly "
                     f"(no padding: use a multiple of {pieces})")
    if "ulysses" in args.methods and args.heads % world:
        parser.error(f"--heads {args.heads}: Ulysses gives each of the {world} ranks whole heads, "
                     f"and {args.heads} do not divide evenly (use a multiple of {world}, or "
                     f"--methods ring,zigzag)")
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


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main():
    args = parse_args()
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank draws the same full tensors, and computes full attention on them: one process.
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    inputs = [torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
              for _ in range(4)]  # q, k, v and the gradient of the output
    full = {"inputs": inputs}
    for causal in (False, True):
        q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(inputs[3])
        full[causal] = (out, q.grad, k.grad, v.grad)
    if rank == 0:
        print(f"{world} ranks ({dist.get_backend()}), batch {args.batch}, {args.heads} heads, "
              f"sequence {args.seq}, head dim {args.head_dim}, float64", flush=True)
    failed, work, sent, checks = False, {}, {}, []
    for method in args.methods:
        for causal in (False, True):
            worst, counts = check_variant(method, causal, full, args)
            work[method, causal] = [c[0] for c in counts]
            sent[method, causal] = [int(c[1]) for c in counts]
            ok = max(worst) <= TOLERANCE
            failed |= not ok
            checks.append({"name": f"{method} {'causal' if causal else 'no mask'}", "method": method,
                           "causal": causal, "ok": ok, "tolerance": TOLERANCE,
                           "worst": dict(zip(("out", "dq", "dk", "dv"), worst))})
            if rank == 0:
                print(f"check: {method:7} {'causal' if causal else 'no mask':7}: max |difference| "
                      f"out {worst[0]:.1e}, dq {worst[1]:.1e}, dk {worst[2]:.1e}, dv {worst[3]:.1e}"
                      f" (<= {TOLERANCE:g}): {'OK' if ok else 'FAILED'}", flush=True)
    if rank == 0:
        for method in ("ring", "zigzag"):
            if method in args.methods:
                blocks = work[method, True]
                print(f"causal work per rank, {method:6} (S/N x S/N blocks, a diagonal one counts "
                      f"1/2): {blocks}, busiest/mean {max(blocks) * world / sum(blocks):.3f}",
                      flush=True)
        for method in args.methods:
            print(f"bytes sent per rank, {method:7} forward + backward: {sent[method, True]}",
                  flush=True)
        print("some checks FAILED" if failed else "all checks passed", flush=True)
        if args.report:
            write_report(args.report, {
                "program": "ring_attention.py", "world": world, "checks": checks,
                "work": {m: work[m, True] for m in ("ring", "zigzag") if m in args.methods},
                "bytes": {m: sent[m, True] for m in args.methods}})
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
