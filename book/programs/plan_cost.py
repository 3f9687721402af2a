"""What a layout of a transformer costs per GPU, from first principles: memory and step time.

Run:  python plan_cost.py --measure hw.json --ranks 4   (matmul rates, bandwidth, overheads, cores)
      torchrun --standalone --nproc-per-node 4 plan_cost.py --sweep hw.json     (one node's link)
      torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --rdzv-endpoint NODE0:29500 \
          plan_cost.py --sweep hw.json                  (on each node K: both link levels)
      python plan_cost.py --hardware hw.json --layers 2 --dim 256 --ffn 1024 --pp 2 --dp-shard 2

Inputs are of three kinds and nothing else: the model's shapes, the layout, and the hardware
(data-sheet figures, or microbenchmarks: matmul rate per shape, memory bandwidth, the time of
one small operation and of a tensor-parallel module's bookkeeping, the cores busy ranks get,
alpha, beta and burst of each link level from a collective sweep). No input comes from a run
of the layout predicted. torch and the standard library only.

Source: the Ultra-Scale Playbook's memory and time accounting ("Finding the best training
configuration"), torch's own schedules (torch/distributed/pipelining/schedules.py) and FSDP2
(torch/distributed/fsdp/_fully_shard), checked against the capstone GPT (gpt/train.py --cost)
on chapter 15's emulated cluster, and against torchtitan's, the Playbook's and picotron's
published runs; no single article covers it.
"""

import argparse
import datetime
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")  # outermost first, as train.py


@dataclass(frozen=True)
class Model:
    layers: int = 4
    dim: int = 64
    heads: int = 4
    kv_heads: int = 0  # 0: as many as heads
    ffn: int = 256  # hidden width of the MLP (of each expert)
    vocab: int = 256
    experts: int = 0
    top_k: int = 1
    shared: int = 0  # always-on experts (DeepSeek style)
    gated: bool = False  # SwiGLU: three weights; else GELU: two
    tied: bool = True  # the head is the embedding's weight
    mask: bool = False  # attention with an explicit (seq x seq) mask, full scores computed
    # under CP, each chunk of queries keeps a boolean mask aligned at its last token (torch's
    # CPU attention materialises causal_lower_right; the GPU kernels take it without one)
    cp_mask: bool = False

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * (self.kv_heads or self.heads)


@dataclass(frozen=True)
class Policy:
    """Bytes per element: the stored parameters (and gradients, optimizer state), the compute
    (FSDP's gathered parameters, activations), the gradient reduction."""
    param: int = 4
    compute: int = 4
    reduce: int = 4
    state: int = 4
    float8: bool = False  # matmuls at the float8 peak
    fused: bool = False  # element-wise chains fused (torch.compile): each reads and writes once


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"  # 1F1B, GPipe, Interleaved1F1B (two stages a rank)
    ac: str = "none"  # none, selective, full
    loss_parallel: bool = True  # the logits stay split over tp (train.py's, torchtitan's loss)
    accumulate: int = 1  # micro-steps a step, gradients synchronised once (a pipeline: more micro-batches)
    zero: int = 0  # 1: AdamW's state split over the dp_replicate ranks (ZeRO-1), weights gathered after

    def sizes(self) -> dict:
        """Each axis's size, outermost first."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def world(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def passes(self) -> int:
        """Forward and backward passes a rank makes in a step: the schedule's micro-batches
        (each accumulation step's, in one schedule) or the accumulation steps."""
        return self.microbatches * self.accumulate if self.pp > 1 else self.accumulate


@dataclass
class Hardware:
    name: str = "cpu"
    peak: float = 1e11  # dense FLOP/s of the compute dtype (data sheet, or measured)
    peak_float8: float = 0.0
    memory: float = 24 * 2**30  # bytes a GPU (a rank) may hold
    bandwidth: float = 1e10  # memory bytes/s (element-wise work, the optimizer)
    gpus_per_node: int = 8
    # each link level: [alpha s a message, beta s a byte, burst bytes passed at once after a pause]
    links: dict = field(default_factory=lambda: {"node": [1e-5, 1e-10, 0], "net": [1e-5, 1e-9, 0]})
    nics: int = 0  # network links a node has, shared by its ranks (0: one per GPU)
    op_seconds: float = 0.0  # one small operation issued from Python (or one kernel launch)
    tp_module_seconds: float = 0.0  # what one tensor-parallel module adds to a forward and backward on
    # the CPU (DTensor's redistributions and hooks); 0 where the CPU runs ahead of the device
    collective_seconds: float = 0.0  # per collective call, beyond alpha
    matmul: list = field(default_factory=list)  # measured [m, k, n, FLOP/s] a rank
    ceiling: float = 1.0  # the best matmul rate / peak (MAMF) where no shape was measured
    ceiling_float8: float = 0.0  # the same for float8 matmuls (0: ceiling)
    attention: float = 0.0  # FLOP/s of the attention kernel (0: as a matmul of its shape)
    attention_backward: float = 0.0  # FLOP/s of its backward, counted as 2.5 x the forward's (0: the same)
    backend: str = "nccl"  # gloo reduce-scatters by an all-reduce
    streams: bool = True  # FSDP's collectives run on their own streams (GPU); else each blocks
    overlap: bool = True  # an asynchronous all-reduce (DDP's) runs while the backward computes
    cores: float = 0.0  # cores all the ranks share, measured with every rank busy (0: a device each)
    sweep: dict = field(default_factory=dict)  # the samples the links were fitted to (plan_cost.py --sweep)
    # measured bus bandwidth (bytes/s) of one collective over every GPU of 1, 2, 4... nodes:
    # {kind: [[nodes, bytes/s], ...]}. A listed kind pays its bytes at the figure for the nodes
    # its group spans, in place of the link's beta, sharing and burst (the measurement ran
    # over whole nodes: the links of each node are in the figure already)
    bus: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)


def matmul_rate(hw: Hardware, m: int, k: int, n: int, float8: bool = False) -> float:
    """FLOP/s of one (m x k) @ (k x n): the nearest measured shape (in log space), else a
    roofline: the ceiling's FLOP/s or the bytes over the memory bandwidth, the slower."""
    if hw.matmul:
        def distance(row):
            return sum(math.log(a / b) ** 2 for a, b in zip(row[:3], (m, k, n)))
        return min(hw.matmul, key=distance)[3]
    fp8 = float8 and hw.peak_float8
    peak = hw.peak_float8 * (hw.ceiling_float8 or hw.ceiling) if fp8 else hw.peak * hw.ceiling
    flops, moved = 2 * m * k * n, 2 * (m * k + k * n + m * n)
    return flops / max(flops / peak, moved / hw.bandwidth)


def shards(rows: int, ranks: int, index: int) -> int:
    """Rows of a dim-0 shard under FSDP2 (padded to a multiple of the ranks: ceil each)."""
    per = -(-rows // ranks)
    return max(0, min(per, rows - index * per))


def coordinates(lay: Layout, rank: int) -> dict:
    out = {}
    for axis in reversed(AXES):
        size = getattr(lay, axis)
        out[axis], rank = rank % size, rank // size
    return out


def fsdp_on(lay: Layout) -> bool:
    return lay.dp_shard * lay.cp * lay.ep > 1 or (lay.dp_replicate > 1 and (lay.tp > 1 or lay.pp > 1))


def stage_parameters(m: Model, lay: Layout, stage: int) -> list:
    """(rows, columns, kind) of every parameter a stage holds, split by TP (Megatron's
    column/row split; the embedding by vocabulary rows; norms whole)."""
    t, d, h = lay.tp, m.dim, m.ffn
    per = -(-m.layers // lay.pp)  # the busiest stage's blocks
    out = []
    for _ in range(per):
        out += [(d, 1, "dense"), (d, 1, "dense")]  # two RMSNorm weights
        out += [(d // t, d, "dense"), (m.kv_dim // t, d, "dense"), (m.kv_dim // t, d, "dense"),
                (d, d // t, "dense")]
        mlp = [(h // t, d, "dense"), (d, h // t, "dense")] + [(h // t, d, "dense")] * m.gated
        if m.experts:
            out.append((m.experts, d, "dense"))  # the router
            local = m.experts // lay.ep
            for _ in range(2 + m.gated):
                out.append((local, d * h, "expert"))
            out += mlp * m.shared
        else:
            out += mlp
    if stage == 0 or (stage == lay.pp - 1 and m.tied):
        out.append((m.vocab // t, d, "dense"))
    if stage == lay.pp - 1:
        out.append((d, 1, "dense"))
        if not m.tied:
            out.append((m.vocab // t, d, "dense"))
    return out


def in_flight(lay: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (of the schedule's lay.passes)."""
    if lay.pp == 1:
        return 1
    if lay.schedule == "GPipe":
        return lay.passes
    if lay.schedule == "Interleaved1F1B":  # warm-up of two chunks, each half a stage
        return min(lay.passes, (lay.pp + 2 * (lay.pp - 1 - stage) + 1) / 2)
    return min(lay.passes, lay.pp - stage)


def activations(m: Model, lay: Layout, pol: Policy, rows: int, seq: int, stage: int, cp_rank: int = 1) -> float:
    """Bytes autograd keeps for one micro-batch on one stage (rows sequences of seq tokens
    on this rank, which is cp_rank on the cp axis). Per block, in units of the rank's
    residual stream x = rows x seq x dim, t = tp:
    - each RMSNorm keeps its input and its normalised input (x / t each under sequence
      parallelism; eager, in float32 at least, as torch's rms_norm upcasts; fused, its input
      only) and the next linear its gathered input (x);
    - attention keeps q, its output and wo's input (x / t each; with one head a rank and no
      CP, that input is a view of the output), and k and v (kv_heads / heads of x / t each,
      every cp rank's: gathered);
    - the MLP keeps its hidden activations (2 a GELU, 4 a SwiGLU, of ffn / dim x / t each);
      a mixture of experts its routed rows (below);
    - per-token statistics (the norms' rstd, attention's log-sum-exp: float32 at least) and
      the rotary tables. A causal kernel keeps no mask: m.mask keeps a seq x seq one;
      m.cp_mask a boolean one for each of a cp rank's two chunks of queries (zig-zag:
      chunks cp_rank and 2 cp - 1 - cp_rank) that does not end on the diagonal.
    Full checkpointing keeps each block's input only. The ends: the token ids; the final
    norm and the log-softmax of the logits, float32 at least (1/t of them under
    loss_parallel, which never gathers them)."""
    t, cp, B = lay.tp, lay.cp, pol.compute
    F = max(B, 4)  # bytes of what is computed in float32 at least
    x = rows * seq * m.dim
    kv = rows * seq * m.kv_dim * cp
    norm = (x // t * B if pol.fused else 2 * x // t * F) + x * B
    stats = 2 * rows * seq // t + rows * m.heads // t * seq
    rotary = 4 * seq * m.dim // m.heads // 2  # cos and sin, of q and of k
    # q, the output, and wo's input: its (heads, tokens) transposed copy, or CP's two chunks joined
    heads = 3 if m.heads // t > 1 or cp > 1 else 2
    per_block = 2 * norm + (heads * x // t + 2 * kv // t + rotary) * B + stats * F
    if m.mask:
        per_block += seq * seq * cp * B
    elif m.cp_mask and cp > 1:  # chunk c ends at (c + 1) x chunk; chunk 0 is on the diagonal
        chunk = seq // 2
        per_block += chunk * chunk * (2 * cp + 1 - (cp_rank == 0))
    hidden = (4 if m.gated else 2) * rows * seq * m.ffn // t * B
    if m.experts:
        # the routed rows in, each expert's hidden activations, its rows out and the gated rows
        # index_add keeps, and the gates; the router's probabilities (float32 at least, its
        # input too), three int64 indices of the choices, and the load-balancing loss's two
        # (sequences x experts) terms
        routed = rows * seq * m.top_k
        per_block += routed * (3 * m.dim + (4 if m.gated else 2) * m.ffn + 1) * B + x * (F - B)
        per_block += rows * seq * m.experts * F + 3 * routed * 8 + 2 * rows * m.experts * F
        per_block += m.shared * hidden
    else:
        per_block += hidden
    if lay.ac == "full":
        per_block = x // t * B
    elif lay.ac == "selective":  # every other block recomputed (torchtitan's layer option)
        per_block = (per_block + x // t * B) / 2
    total = -(-m.layers // lay.pp) * per_block
    if stage == 0:
        total += rows * seq * 8  # the token ids
    if stage == lay.pp - 1:  # the final norm and its rstd, the log-softmax, the loss
        vocab = m.vocab // t if lay.loss_parallel else m.vocab
        total += norm + rows * seq // t * F + (rows * seq * vocab + 1) * F
    return total


def memory(m: Model, lay: Layout, pol: Policy, batch: int, seq: int, rank: int = 0) -> dict:
    """Bytes one rank holds at its peak, by component."""
    at = coordinates(lay, rank)
    stage = at["pp"]
    dense_n = lay.dp_shard * lay.cp * lay.ep if fsdp_on(lay) else 1
    dense_i = (at["dp_shard"] * lay.cp + at["cp"]) * lay.ep + at["ep"] if fsdp_on(lay) else 0
    exp_n = lay.dp_shard * lay.cp if fsdp_on(lay) else 1
    exp_i = at["dp_shard"] * lay.cp + at["cp"] if fsdp_on(lay) else 0
    params, count, whole_block, whole = 0, 0, 0, 0
    for r, c, kind in stage_parameters(m, lay, stage):
        n, i = (exp_n, exp_i) if kind == "expert" else (dense_n, dense_i)
        params += shards(r, n, i) * c
        whole += r * c
        count += 1
    per = -(-m.layers // lay.pp)  # the busiest stage's blocks
    whole_block = (whole - (m.vocab // lay.tp * m.dim) * (1 + (not m.tied and stage == lay.pp - 1))) / per
    rows = batch // lay.data_parallel // lay.passes
    act = in_flight(lay, stage) * activations(m, lay, pol, rows, seq // lay.cp, stage, at["cp"])
    split = lay.dp_replicate if lay.zero and dense_n == 1 else 1  # ZeRO-1 (no axis shards the weights)
    out = {"parameters": params * pol.param, "gradients": params * pol.param,
           "optimizer": (2 * params / split + count) * pol.state,  # AdamW's two moments, a step counter each
           "activations": act}
    unsharded = 0.0
    if fsdp_on(lay) and dense_n > 1:
        if lay.pp > 1:  # reshard_after_forward=False: the stage stays gathered, grads too
            unsharded = whole * (pol.compute + pol.reduce)
        else:  # the block in use and the next (prefetch), parameters and gradients
            unsharded = 2 * whole_block * (pol.compute + pol.reduce)
    out["fsdp_unsharded"] = unsharded
    if pol.compute != pol.param and not fsdp_on(lay):
        out["fsdp_unsharded"] = whole * pol.compute  # a low-precision copy of the weights
    out["communication"] = 0 if lay.world == 1 else min(25 * 2**20, params * pol.reduce) * 2
    return out


def ring(kind: str, n: int, gloo: bool = False) -> tuple:
    """(messages in a row, bytes on the busiest link per byte of the whole tensor) of one call
    over n ranks. gloo reduce-scatters by an all-reduce (chapter 15 counts it on the wire)."""
    if kind == "all_reduce" or (kind == "reduce_scatter" and gloo):
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "send_recv":
        return 1, 1.0
    return n - 1, (n - 1) / n  # all-gather, reduce-scatter, all-to-all


def members(lay: Layout, axes: tuple) -> list:
    """The ranks of rank 0's group over these mesh axes (tp innermost, as torchrun numbers)."""
    ranks, stride = [0], 1
    for axis in reversed(AXES):
        size = getattr(lay, axis)
        if axis in axes:
            ranks = [r + i * stride for i in range(size) for r in ranks]
        stride *= size
    return sorted(ranks)


def link(hw: Hardware, lay: Layout, axes: tuple) -> tuple:
    """The link a group over these axes crosses ('node' or 'net') and how many transfers share
    it when every group of these axes runs at once: each group spanning nodes sends one ring
    edge out of each node, and a node has hw.nics network links (0: one per GPU)."""
    key = (lay, tuple(axes), hw.gpus_per_node, hw.nics)
    if key not in _LINKS:
        group, per_node = members(lay, axes), hw.gpus_per_node
        if len({r // per_node for r in group}) == 1:
            _LINKS[key] = ("node", 1.0)
        else:
            flows = min(per_node, lay.world) // sum(r // per_node == 0 for r in group)
            _LINKS[key] = ("net", max(1.0, flows / (hw.nics or per_node)))
    return _LINKS[key]


_LINKS = {}  # (layout, axes, GPUs a node, NICs a node) -> link()


def collective(hw: Hardware, lay: Layout, kind: str, call_bytes: float, axes: tuple, calls: int = 1,
               ranks: int = 0, gap: float = math.inf) -> float:
    """Seconds of `calls` collectives of this kind, each over a whole tensor of call_bytes, on
    the group of these axes (ranks: its size, when not all the axes' ranks). Per call: alpha
    per message in a row, the per-call overhead, and beta per byte on the busiest link (times
    the transfers sharing it), less the link's burst: the bytes it passes at once after a
    pause (a tc tbf bucket, which refills at the link's rate in the `gap` seconds of compute
    before the call; 0 on a real link). A kind in hw.bus pays its bytes at the bandwidth
    measured over as many nodes as the group spans instead: no sharing, no burst."""
    n = ranks or math.prod(getattr(lay, a) for a in axes)
    if n == 1 or call_bytes <= 0 or calls <= 0:
        return 0.0
    level, share = link(hw, lay, axes)
    alpha, beta, burst = (list(hw.links[level]) + [0.0])[:3]
    if kind in hw.bus:  # measured over whole nodes: the sharing is in the figure
        spans = len({r // hw.gpus_per_node for r in members(lay, axes)})
        beta, share, burst = 1 / bus_rate(hw.bus[kind], spans), 1.0, 0.0
    steps, wire = ring(kind, n, hw.backend == "gloo")
    credit = min(burst, gap / beta) if beta else burst
    return calls * (alpha * steps + hw.collective_seconds
                    + beta * max(0.0, share * wire * call_bytes - credit))


def bus_rate(table: list, nodes: int) -> float:
    """Bytes/s of a measured bus bandwidth at this many nodes: linear in log-log between the
    measured node counts; outside the measured range, the nearest measured value."""
    (n0, b0), *rest = sorted(table)
    if nodes <= n0 or not rest:
        return b0
    for n1, b1 in rest:
        if nodes <= n1:
            t = math.log(nodes / n0) / math.log(n1 / n0)
            return math.exp(math.log(b0) + t * math.log(b1 / b0))
        n0, b0 = n1, b1
    return b0


def microbatch(m: Model, lay: Layout, pol: Policy, hw: Hardware, rows: int, seq: int, stage: int) -> dict:
    """One micro-batch on one rank of a stage (rows sequences of seq tokens, split over cp):
    seconds of its forward and backward compute at the rank's full speed, and of the
    collectives inside them it waits for (TP's, CP's, EP's). Each linear layer is three
    matmuls at the rate of their shapes (float8: its inputs scaled and cast, 5 bytes an
    element); attention's backward recomputes the scores (five matmuls to the forward's two);
    element-wise work moves its tensors over the memory bandwidth once forward and twice
    backward; each operation costs hw.op_seconds."""
    t, cp, B = lay.tp, lay.cp, pol.compute
    tokens, per = rows * seq // cp, -(-m.layers // lay.pp)
    d, h, hd = m.dim, m.ffn, m.dim // m.heads

    def linear(a, k, n, times=1):  # (a x k) @ (k x n): forward; input and weight gradients
        flop, r = 2 * a * k * n * times, matmul_rate
        cast = 5 * times / hw.bandwidth if pol.float8 else 0.0
        return (flop / r(hw, a, k, n, pol.float8) + cast * (a * k + k * n),
                flop / r(hw, a, n, k, pol.float8) + flop / r(hw, k, a, n, pol.float8)
                + cast * (a * n + k * n + a * k))
    parts = [linear(tokens, d, d // t), linear(tokens, d, m.kv_dim // t, 2), linear(tokens, d // t, d)]
    hidden = tokens * h // t
    if m.experts:  # balanced routing: each expert meets tokens x top_k x ep / experts rows
        local, rows_e = m.experts // lay.ep, max(1, tokens * m.top_k * lay.ep // m.experts)
        parts += [linear(rows_e, d, h, local * (1 + m.gated)), linear(rows_e, h, d, local),
                  linear(tokens, d, m.experts), linear(tokens, d, h // t, m.shared * (1 + m.gated)),
                  linear(tokens, h // t, d, m.shared)]
        hidden = tokens * m.top_k * h + m.shared * tokens * h // t
    else:
        parts += [linear(tokens, d, h // t, 1 + m.gated), linear(tokens, h // t, d)]
    # keys a query meets: all with an explicit mask, half under a causal kernel (zig-zag CP's
    # two chunks a rank too); with m.cp_mask each chunk's scores are computed up to its end,
    # masked: (2 cp + 1) / (4 cp) of the keys
    span = seq if m.mask else seq * (2 * cp + 1) / (4 * cp) if m.cp_mask and cp > 1 else seq / 2
    scores = 4 * rows * (m.heads // t) * (seq // cp) * span * hd
    rate = hw.attention or matmul_rate(hw, seq // cp, hd, span)
    parts.append((scores / rate, 2.5 * scores / (hw.attention_backward or rate)))
    # element-wise, forward, in bytes: per block two norms and two residual adds on the
    # (sequence-parallel) stream x, rotary on q and k, the activation (GELU reads and writes
    # hidden once, SwiGLU's silu and product 2.5 times), attention's layout copies of q, k, v
    # and its output; under CP the gathered keys and values put in sequence order. Eager, a norm
    # is four float32 kernels (and two casts), rotary four float32 kernels; fused, each chain
    # reads its inputs and writes its output once.
    x, q, kv, f32 = tokens * d // t, tokens * d // t, tokens * m.kv_dim // t, 4
    act = (2.5 if m.gated else 1.0) * 2 * B * hidden
    if pol.fused:
        moved = 2 * 2 * B * x + 2 * B * (q + kv) + act + 2 * B * (q + 2 * kv + x)
    else:
        moved = 2 * (8 * f32 + 2 * B) * x + 8 * f32 * (q + kv) + 2 * 3 * B * x + act + 2 * B * (q + 2 * kv + x)
    moved += 2 * B * 2 * cp * kv * (cp > 1)
    ops = 15 + 10 * (t > 1) + 4 * (cp > 1) + 8 * bool(m.experts)
    parts.append((moved / hw.bandwidth + ops * hw.op_seconds, 2 * (moved / hw.bandwidth + ops * hw.op_seconds)))
    if t > 1:  # tensor-parallel modules a block: its linears, two norms, two input redistributions
        tp_modules = (6 + m.gated + 4) * hw.tp_module_seconds
        parts.append((tp_modules / 3, 2 * tp_modules / 3))
    forward, backward = (per * sum(p[i] for p in parts) for i in (0, 1))
    ends = ((stage == 0) + 2 * (stage == lay.pp - 1)) * hw.tp_module_seconds * (t > 1)  # embedding; norm, head
    forward, backward = forward + ends / 3, backward + 2 * ends / 3
    if stage == lay.pp - 1:  # final norm, head, loss (cross-entropy in float32)
        head = linear(tokens, d, m.vocab // t)
        logits = 3 * tokens * (m.vocab // t if lay.loss_parallel else m.vocab) * 4 / hw.bandwidth
        forward += head[0] + logits + 10 * hw.op_seconds
        backward += head[1] + logits + 20 * hw.op_seconds
    # blocking collectives: TP (sequence parallel) gathers the stream before attention and the
    # MLP and reduce-scatters after them, the backward the other way round; CP gathers keys
    # and values and reduce-scatters their gradients; EP sends its counts (int64), then rows to
    # their experts and back; under CP a mixture's balancing loss sums each sequence's choices
    # (int64, sequences x experts); loss_parallel all-reduces three numbers a token (the largest
    # logit, the sum of exponentials, the target's logit; float32 at least). Between two calls
    # the ranks compute (all of them at once: at cores / ranks of full speed).
    x_bytes, kv_bytes = tokens * d * B, rows * seq * m.kv_dim // t * B
    last = stage == lay.pp - 1
    split_loss = lay.loss_parallel and t > 1 and last
    calls = (per * (4 * (t > 1) + 2 * (cp > 1) + 3 * (lay.ep > 1) + (cp > 1 and m.experts > 0))
             + 3 * (t > 1) + 3 * split_loss)
    slow = max(1.0, lay.world / hw.cores) if hw.cores else 1.0
    gf, gb = forward * slow / max(1, calls), backward * slow / max(1, calls)

    def tp(kind, calls_, gap, size=x_bytes):
        return collective(hw, lay, kind, size, ("tp",), calls_, gap=gap)
    fwd = (tp("all_gather", 2 * per, gf) + tp("reduce_scatter", 2 * per, gf)
           + collective(hw, lay, "all_gather", kv_bytes, ("cp",), 2 * per, gap=gf))
    bwd = (tp("all_gather", 2 * per, gb) + tp("reduce_scatter", 2 * per, gb)
           + collective(hw, lay, "reduce_scatter", kv_bytes, ("cp",), 2 * per, gap=gb))
    if m.experts:
        sent = tokens * m.top_k * d * B
        fwd += (collective(hw, lay, "all_to_all", m.experts * 8, ("ep",), per, gap=gf)
                + collective(hw, lay, "all_to_all", sent, ("ep",), 2 * per, gap=gf)
                + collective(hw, lay, "all_reduce", rows * m.experts * 8, ("cp",), per, gap=gf))
        bwd += collective(hw, lay, "all_to_all", sent, ("ep",), 2 * per, gap=gb)
    if stage == 0:  # the embedding: its output reduce-scattered over tp, the gradient gathered
        fwd += tp("reduce_scatter", 1, gf)
        bwd += tp("all_gather", 1, gb)
    if last:  # the head's input gathered; the vocabulary-sharded logits kept split, or gathered whole
        fwd += tp("all_gather", 1, gf) + (tp("all_reduce", 3, gf, tokens * max(B, 4)) if split_loss
                                          else tp("all_gather", 1, gf, tokens * m.vocab * B))
        bwd += tp("reduce_scatter", 1, gb)
    redo = {"none": 0.0, "selective": 0.5, "full": 1.0}[lay.ac]  # recomputed in the backward
    return {"forward": forward, "backward": backward + redo * forward, "forward_comm": fwd,
            "backward_comm": bwd + redo * fwd, "send": tokens * d // t * B}


def order(schedule: str, stages: int, stage: int, microbatches: int) -> list:
    """The forwards and backwards of a stage in the order torch's schedules run them."""
    if schedule == "GPipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warm = min(microbatches, stages - stage)  # 1F1B: a warm-up, then one backward, one forward
    out, f = [("F", i) for i in range(warm)], warm
    for b in range(microbatches):
        out.append(("B", b))
        if f < microbatches:
            out.append(("F", f))
            f += 1
    return out


def simulate(plans: list, ranks_per_stage: int, cores: float) -> tuple:
    """Run the stages' plans side by side. A plan is a list of ('work', s): s seconds of compute
    at a rank's full speed; ('wait', s, part): a collective that blocks s seconds; ('send',
    key, link, s): a transfer that takes s seconds once the link is free; ('recv', key): wait
    for it. The ranks of every stage share `cores` cores (0: a device each): with k ranks
    computing, each runs at cores / k of its speed. Returns each stage's end and its seconds
    by part (compute, each wait's part, 'bubble' for receiving)."""
    n, now = len(plans), 0.0
    at, left, end = [0] * n, [None] * n, [None] * n
    arrive, free = {}, {}
    parts = [{"compute": 0.0, "bubble": 0.0} for _ in range(n)]
    if not cores:  # a device each: every step starts when its stage and its input are ready
        clock = [0.0] * n
        while None in end:
            for s in range(n):
                while end[s] is None:
                    if at[s] == len(plans[s]):
                        end[s] = clock[s]
                        break
                    step = plans[s][at[s]]
                    if step[0] == "recv":
                        if step[1] not in arrive:
                            break  # its sender has not sent it yet: another stage moves first
                        parts[s]["bubble"] += max(0.0, arrive[step[1]] - clock[s])
                        clock[s] = max(clock[s], arrive[step[1]])
                    elif step[0] == "send":  # one sender a link: its sends come in time order
                        start = max(clock[s], free.get(step[2], 0.0))
                        free[step[2]] = arrive[step[1]] = start + step[3]
                    else:
                        part = "compute" if step[0] == "work" else step[2]
                        parts[s][part] = parts[s].get(part, 0.0) + step[1]
                        clock[s] += step[1]
                    at[s] += 1
        return end, parts
    while None in end:
        moved = True
        while moved:  # everything that takes no time
            moved = False
            for s in range(n):
                if end[s] is not None:
                    continue
                if at[s] == len(plans[s]):
                    end[s], moved = now, True
                    continue
                step = plans[s][at[s]]
                if step[0] == "send":
                    start = max(now, free.get(step[2], 0.0))
                    free[step[2]] = arrive[step[1]] = start + step[3]
                elif step[0] == "recv" and arrive.get(step[1], math.inf) > now:
                    continue
                elif step[0] in ("work", "wait"):
                    if left[s] is None:
                        left[s] = step[1]
                    if left[s] > 1e-12:
                        continue
                    left[s] = None
                at[s] += 1
                moved = True
        live = [s for s in range(n) if end[s] is None]
        if not live:
            break
        busy = [s for s in live if plans[s][at[s]][0] == "work"]
        speed = min(1.0, cores / (len(busy) * ranks_per_stage)) if cores and busy else 1.0
        gaps = [left[s] / speed for s in busy]
        gaps += [left[s] for s in live if plans[s][at[s]][0] == "wait"]
        gaps += [arrive[plans[s][at[s]][1]] - now for s in live
                 if plans[s][at[s]][0] == "recv" and plans[s][at[s]][1] in arrive]
        gap = min(gaps)  # the plans are built so that some stage can always move
        for s in live:
            step = plans[s][at[s]]
            if step[0] == "work":
                left[s] -= gap * speed
                parts[s]["compute"] += gap
            elif step[0] == "wait":
                left[s] -= gap
                parts[s][step[2]] = parts[s].get(step[2], 0.0) + gap
            else:
                parts[s]["bubble"] += gap
        now += gap
    return end, parts


def ddp_exposed(hw: Hardware, lay: Layout, pol: Policy, backward: float, stage_bytes: float) -> float:
    """DDP's buckets (1 MiB first, then 25 MiB, last layers first) each all-reduced once
    backward has made it, one after another; with hw.overlap they run beside the backward
    and what ends after it shows, else all of it."""
    buckets, left, cap = [], stage_bytes, 2**20
    while left > 0:
        buckets.append(min(cap, left))
        left -= buckets[-1]
        cap = 25 * 2**20
    end, made = 0.0, 0.0
    for size in buckets:
        made += size
        ready = backward * made / stage_bytes if hw.overlap else backward
        gap = max(0.0, ready - end)  # the link rested since the last bucket
        end = max(end, ready) + collective(hw, lay, "all_reduce", size, ("dp_replicate",), gap=gap)
    return max(0.0, end - backward)


def step(m: Model, lay: Layout, pol: Policy, hw: Hardware, batch: int, seq: int) -> dict:
    """Seconds of one optimizer step on the rank that ends last, by part. Each stage's
    micro-batches run in the schedule's order, a pipeline's activations cross the link
    between stages, and ranks share hw.cores (simulate). The overlap rule: TP, CP and EP
    collectives block; FSDP's gathers and reductions run beside compute on their own streams
    (hw.streams, a GPU) and block otherwise (gloo: every call waits); DDP's bucket
    all-reduces run beside the backward where the link, not a core, is busy (hw.overlap).
    Gradients are reduced once a step, after the last backward (accumulation steps add up
    where they are; a pipeline runs them as more micro-batches of its one schedule)."""
    mb = lay.passes
    rows = batch // lay.data_parallel // mb
    per = -(-m.layers // lay.pp)
    cost = [microbatch(m, lay, pol, hw, rows, seq, s) for s in range(lay.pp)]
    fsdp_axes = ("dp_shard", "cp", "ep")
    shard_n = math.prod(getattr(lay, a) for a in fsdp_axes)
    slow = max(1.0, lay.world / hw.cores) if hw.cores else 1.0  # every rank computing at once
    plans, elems, sync = [], [], 0.0
    for s in range(lay.pp):
        params = stage_parameters(m, lay, s)
        embed = (m.vocab // lay.tp) * m.dim * ((s == 0 or (s == lay.pp - 1 and m.tied))
                                               + (not m.tied and s == lay.pp - 1))
        root = embed + m.dim * (s == lay.pp - 1)
        block = (sum(r * c for r, c, _ in params) - root) / per
        gather = ag = rs = ar = 0.0
        if fsdp_on(lay):  # per group: the blocks and the root (embedding, final norm)
            times = 1 if lay.pp > 1 else 2  # a pipeline keeps its stage gathered
            # a forward gather follows a block's forward; in the backward a block's reduction and
            # the next gather follow its backward together; a pipeline reduces all at the end
            gf, gb = (cost[s][k] * slow / per for k in ("forward", "backward"))
            gb = gb / 2 if lay.pp == 1 else 0.0

            def fsdp(kind, size, calls, gap, axes=fsdp_axes):
                return collective(hw, lay, kind, size, axes, calls, gap=gap)
            ag = (fsdp("all_gather", block * pol.compute, per, gf) + fsdp("all_gather", root * pol.compute, times, gf)
                  + fsdp("all_gather", block * pol.compute, per * (times - 1), gb))
            rs = (fsdp("reduce_scatter", block * pol.reduce, per, gb)
                  + fsdp("reduce_scatter", root * pol.reduce, 1, gb))
            ar = (fsdp("all_reduce", block * pol.reduce / shard_n, per, 0.0, ("dp_replicate",))
                  + fsdp("all_reduce", root * pol.reduce / shard_n, 1, 0.0, ("dp_replicate",)))
            gather = ag / ((per + 1) * times)
        work, plan, after = cost[s], [], 0.0
        busy = mb * (work["forward"] + work["backward"])
        if fsdp_on(lay) and lay.pp > 1:  # gathered before the first forward, reduced after the last
            plan.append(("wait", gather if hw.streams else ag, "data_parallel"))  # backward: nothing
            after = rs + ar + (max(0.0, ag - gather - busy) if hw.streams else 0.0)  # hides them
        elif fsdp_on(lay) and hw.streams:  # beside this stage's compute, but the first gather
            after = max(0.0, mb * ag + rs + ar - busy) + gather
        sends = {up: collective(hw, lay, "send_recv", work["send"], ("pp",), ranks=2,
                                gap=work["forward" if up else "backward"] * slow) for up in (True, False)}
        for kind, i in order(lay.schedule, lay.pp, s, mb):
            up = kind == "F"
            if (s > 0 if up else s < lay.pp - 1):
                plan.append(("recv", (kind, s, i)))
            plan.append(("work", work["forward" if up else "backward"]))
            plan.append(("wait", work["forward_comm" if up else "backward_comm"], "tp_cp_ep_pp"))
            if lay.pp == 1 and fsdp_on(lay) and not hw.streams:  # each call blocks, in order
                plan.append(("wait", ag / 2 + (0.0 if up or i < mb - 1 else rs + ar), "data_parallel"))
            to = s + 1 if up else s - 1
            if 0 <= to < lay.pp:
                plan.append(("send", (kind, to, i), (kind, min(s, to)), sends[up]))
        plan.append(("wait", after, "data_parallel"))
        plans.append(plan)
        elems.append(sum(r * c for r, c, _ in params))
    end, parts = simulate(plans, lay.world // lay.pp, hw.cores)
    last = max(range(lay.pp), key=lambda s: end[s])
    out = {k: parts[last].get(k, 0.0) for k in ("compute", "bubble", "tp_cp_ep_pp", "data_parallel")}
    if lay.schedule == "Interleaved1F1B":  # two chunks a rank: the idle slots halve (simulated as 1F1B)
        out["bubble"] /= 2
    if lay.dp_replicate > 1 and not fsdp_on(lay):  # DDP
        speed = min(1.0, hw.cores / lay.world) if hw.cores else 1.0
        out["data_parallel"] += ddp_exposed(hw, lay, pol, cost[0]["backward"] / speed, elems[0] * pol.reduce)
    if lay.zero and lay.dp_replicate > 1:  # each replica updated its share: the weights gathered again
        out["data_parallel"] += collective(hw, lay, "all_gather", max(elems) * pol.compute, ("dp_replicate",))
    # after the schedule: the norms' gradients, partial sums over tp (each rank saw its part of
    # the sequence), summed one by one; the tied embedding's gradient summed over the first
    # and last stage; the gradient norm, the loss averaged (and sent across stages)
    if lay.tp > 1:
        sync += collective(hw, lay, "all_reduce", m.dim * pol.compute, ("tp",), 2 * per + 1)
    if lay.pp > 1 and m.tied:
        local = m.vocab // lay.tp * m.dim / (shard_n if fsdp_on(lay) else 1)
        sync += collective(hw, lay, "all_reduce", local * pol.reduce, ("pp",), ranks=2,
                           gap=cost[0]["backward"] * slow)
    sync += grad_norm(m, lay, pol, hw)
    sync += collective(hw, lay, "all_reduce", 8, ("dp_replicate", "dp_shard", "cp", "ep"))
    sync += collective(hw, lay, "all_reduce", 8, ("pp",))
    out["sync"] = sync
    local = memory(m, lay, pol, batch, seq)["parameters"] / pol.param
    speed = min(1.0, hw.cores / lay.world) if hw.cores else 1.0
    optimizer = local * (pol.param * 2 + pol.state * 4) / hw.bandwidth
    optimizer += 12 * hw.op_seconds * len(stage_parameters(m, lay, 0))
    out["optimizer"] = optimizer / speed
    out["total"] = sum(out.values())
    return out


def grad_norm(m: Model, lay: Layout, pol: Policy, hw: Hardware) -> float:
    """Seconds of the gradient norm's all-reduces (torch.nn.utils.get_total_norm, as train.py
    clips): one number a gradient tensor, over each mesh dimension that shards the gradients
    (FSDP's, TP's; DDP's are whole: none); the experts' own under EP, and one number over ep;
    one over pp."""
    kinds = [kind for _, _, kind in stage_parameters(m, lay, lay.pp - 1)]
    experts = kinds.count("expert") if lay.ep > 1 else 0
    shards = lay.dp_shard * lay.cp * lay.ep > 1 and fsdp_on(lay)
    out = collective(hw, lay, "all_reduce", (len(kinds) - experts) * pol.param, ("dp_shard", "cp", "ep"),
                     calls=int(shards))
    out += collective(hw, lay, "all_reduce", (len(kinds) - experts) * pol.param, ("tp",))
    if experts:
        out += collective(hw, lay, "all_reduce", experts * pol.param, ("dp_shard", "cp"), calls=int(fsdp_on(lay)))
        out += collective(hw, lay, "all_reduce", 8, ("ep",))
    return out + collective(hw, lay, "all_reduce", 8, ("pp",))


def flops(m: Model, batch: int, seq: int) -> float:
    """Model FLOPs of a step: 6 x matmul parameters per token plus attention (12 x layers x
    dim x seq per token; the causal half without a mask)."""
    h = m.ffn * (3 if m.gated else 2) * m.dim
    mlp = h * (m.top_k + m.shared) + m.dim * m.experts if m.experts else h
    per_layer = 2 * m.dim * m.dim + 2 * m.dim * m.kv_dim + mlp
    params = m.layers * per_layer + m.vocab * m.dim
    attn = 12 * m.layers * m.dim * seq * (1 if m.mask else 0.5)
    return batch * seq * (6 * params + attn)


def stage_memory(m: Model, lay: Layout, pol: Policy, batch: int, seq: int) -> list:
    """Memory of each stage's busiest rank, by component: its first rank holds the largest
    (ceil) shards."""
    per_stage = lay.world // lay.pp
    return [memory(m, lay, pol, batch, seq, stage * per_stage) for stage in range(lay.pp)]


def peak_memory(mems: list) -> float:
    """What one GPU must hold: the largest of the stages' busiest ranks (``stage_memory``)."""
    return max(sum(x.values()) for x in mems)


def predict(m: Model, lay: Layout, pol: Policy, hw: Hardware, batch: int, seq: int) -> dict:
    """The whole prediction: memory of each stage's busiest rank, the step and its parts,
    tokens/s a GPU and MFU against the data-sheet peak."""
    mems = stage_memory(m, lay, pol, batch, seq)
    s = step(m, lay, pol, hw, batch, seq)
    peak = hw.peak_float8 if pol.float8 and hw.peak_float8 else hw.peak
    tokens = batch * seq / s["total"] / lay.world
    return {"memory": mems, "peak_memory": peak_memory(mems), "step": s,
            "tokens_per_gpu": tokens, "mfu": flops(m, batch, seq) / s["total"] / lay.world / hw.peak,
            "peak_used": peak}


def _timed(fn, seconds):
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def _busy(barrier, out, seconds):
    """One of several processes: the rate of a middle-sized matmul while the others run theirs."""
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    barrier.wait(timeout=60)  # a sibling that never came: BrokenBarrierError, not a hang
    out.put(2 * 256**3 / _timed(lambda: a @ b, seconds))


def _tp_module(seconds):
    """What a tensor-parallel module adds to a forward and backward: a column- and a row-split
    Linear on a mesh of one rank against the same two plain, tiny (its own work is DTensor's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(2, 4, 4)
        pair = [torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
                for _ in range(2)]
        parallelize_module(pair[1], init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
        plain, split = (_timed(lambda m=m: m(x).sum().backward(), 10 * seconds) for m in pair)
        return max(0.0, split - plain) / 2
    finally:
        dist.destroy_process_group()


def measure(path, ranks=1, seconds=0.1):
    """This machine's matmul rate per shape (one thread, as each rank runs), its memory
    bandwidth, the time of one small operation, what a tensor-parallel module adds, and the
    cores `ranks` busy processes get (their matmul rate together over one process's alone):
    written to path (JSON)."""
    torch.set_num_threads(1)
    rows = []
    for m_ in (64, 256, 1024):
        for k in (16, 64, 256, 1024):
            for n in (16, 64, 256, 1024):
                a, b = torch.randn(m_, k), torch.randn(k, n)
                rows.append([m_, k, n, 2 * m_ * k * n / _timed(lambda a=a, b=b: a @ b, seconds)])
    big = torch.randn(2**22)
    bandwidth = 2 * big.numel() * 4 / _timed(lambda: big.mul(1.0001), seconds)
    tiny = torch.randn(8)
    op = _timed(lambda: tiny.add(1.0), seconds)
    cores = 0.0
    if ranks > 1:
        # one process's rate: the best of five windows, so that a window another process
        # shared does not pass for this machine's speed (the busy ranks' rates are shared)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        alone = max(2 * 256**3 / _timed(lambda: a @ b, seconds) for _ in range(5))
        ctx = multiprocessing.get_context("fork")
        barrier, out = ctx.Barrier(ranks), ctx.Queue()
        # daemons: whatever happens here, none outlives this process
        procs = [ctx.Process(target=_busy, args=(barrier, out, 10 * seconds), daemon=True)
                 for _ in range(ranks)]
        for proc in procs:
            proc.start()
        rates = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        cores = sum(rates) / alone
    tp_module = _tp_module(seconds)
    hw = Hardware(name="this-machine", peak=max(r[3] for r in rows), memory=os.sysconf("SC_PAGE_SIZE")
                  * os.sysconf("SC_PHYS_PAGES"), bandwidth=bandwidth, gpus_per_node=64,
                  op_seconds=op, tp_module_seconds=tp_module, matmul=rows, backend="gloo", streams=False,
                  overlap=False,
                  cores=cores, sources={"all": f"measured by plan_cost.py --measure, {time.strftime('%Y-%m-%d')}"})
    if os.path.exists(path):
        with open(path) as f:
            hw.links = json.load(f).get("links", hw.links)
    with open(path, "w") as f:
        json.dump(asdict(hw), f)


def fit(samples):
    """alpha, beta, burst of a link from [(messages in a row, bytes on the link, seconds)] of
    one kind of call: alpha from the three smallest calls (their bytes pass at once, only
    latency is left: the middle one of them), then seconds - messages x alpha = beta x
    max(0, bytes - burst) by least squares for each burst tried (0 and each sampled size but
    the two largest), the best kept. A burst is what a tc tbf link passes at once after a
    pause (its bucket); a real link has none."""
    small = sorted(samples, key=lambda x: x[1])[:3]
    alpha = sorted(t / k for k, _, t in small)[1]  # the middle one of the three smallest calls
    best = None
    for burst in [0.0] + sorted({x[1] for x in samples})[:-2]:
        rows = [(max(0.0, w - burst), t - k * alpha) for k, w, t in samples]
        beta = sum(w * t for w, t in rows) / sum(w * w for w, _ in rows)
        error = sum((beta * w - t) ** 2 for w, t in rows)
        if beta > 0 and (best is None or error < best[0]):
            best = (error, [alpha, beta, burst])
    return best[1]


def sweep(path, repeats=5):
    """Under torchrun: all-reduces of several sizes inside every node at once (the ranks of a
    node share its cores, as in training) and, with several nodes, across them (one rank a
    node, one transfer on each link): alpha, beta and burst of each link level (fit), added
    to path (JSON) by rank 0."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local
    inside = [dist.new_group(list(range(k * local, (k + 1) * local))) for k in range(nodes)]
    mine = list(range(rank // local * local, (rank // local + 1) * local))
    levels = {"node": (inside[rank // local], mine, (2**10, 2**14, 2**16, 2**18, 2**20, 2**22))}
    if nodes > 1:
        across = list(range(0, world, local))
        levels["net"] = (dist.new_group(across), across,
                         (2**10, 2**14, 2**15, 2**16, 2**17, 2**18, 2**19, 2**20, 2**21))
    found = {}
    for level, (group, ranks, sizes) in levels.items():
        n = len(ranks)
        samples = []
        for size in sizes:
            x = torch.zeros(size // 4)
            times = []
            for _ in range(repeats):
                dist.barrier()
                time.sleep(0.05)  # a pause, as compute makes between collectives
                start = time.perf_counter()
                if rank in ranks and n > 1:
                    dist.all_reduce(x, group=group)
                times.append(time.perf_counter() - start)
            samples.append((2 * (n - 1), 2 * (n - 1) / n * size, sorted(times)[len(times) // 2]))
        found[level] = samples
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return
    hw = json.load(open(path)) if os.path.exists(path) else asdict(Hardware())
    hw["links"] = {level: fit(samples) for level, samples in found.items() if samples[0][0]}
    hw["sweep"] = found
    hw["links"].setdefault("net", hw["links"].get("node", [0.0, 0.0, 0.0]))
    hw["links"].setdefault("node", hw["links"]["net"])
    hw["gpus_per_node"], hw["collective_seconds"] = local if nodes > 1 else hw.get("gpus_per_node", local), 0.0
    hw.setdefault("sources", {})["links"] = (f"gloo all-reduce sweep, {nodes} node(s) x {local} ranks, "
                                             f"{time.strftime('%Y-%m-%d')}")
    with open(path, "w") as f:
        json.dump(hw, f)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit status 2, nothing started or written
        sys.stderr.write(f"plan_cost.py: {message}\n")
        raise SystemExit(2)


def main(argv=None):
    p = Parser(prog="plan_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--measure", metavar="FILE", help="measure this machine into FILE (JSON)")
    p.add_argument("--sweep", metavar="FILE", help="under torchrun: add each link level to FILE")
    p.add_argument("--ranks", type=int, default=1, help="with --measure: busy processes sharing the cores")
    p.add_argument("--seconds", type=float, default=0.1,
                   help="with --measure: how long each timing runs (default 0.1)")
    p.add_argument("--repeats", type=int, default=5,
                   help="with --sweep: timings of each size, the median kept (default 5)")
    p.add_argument("--hardware", metavar="FILE", help="predict with the hardware in FILE")
    for name, value in asdict(Model()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    for name, value in asdict(Layout()).items():
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    p.add_argument("--bytes", type=int, default=4, help="bytes of every element (float32: 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    a = p.parse_args(argv)
    for name in ("measure", "sweep"):
        path = getattr(a, name)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"--{name} {path}: no folder {os.path.dirname(os.path.abspath(path))}")
    if a.measure:
        if a.ranks < 1:
            p.error(f"--ranks {a.ranks}: must be at least 1")
        if not a.seconds > 0:
            p.error(f"--seconds {a.seconds:g}: must be more than 0")
        return measure(a.measure, a.ranks, a.seconds)
    if a.sweep:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            p.error("--sweep: run it under torchrun (it times all-reduces between the ranks)")
        if a.repeats < 1:
            p.error(f"--repeats {a.repeats}: must be at least 1")
        return sweep(a.sweep, a.repeats)
    if not a.hardware or not os.path.isfile(a.hardware):
        p.error(f"--hardware {a.hardware or 'FILE'}: no such file (write one with --measure and --sweep)")
    m = Model(**{k: getattr(a, k) for k in asdict(Model())})
    lay = Layout(**{k: getattr(a, k) for k in asdict(Layout())})
    for name in ("layers", "dim", "heads", "ffn", "vocab", "batch", "seq", "bytes", *AXES, "microbatches"):
        value = getattr(a, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if (m.dim % m.heads or m.layers % lay.pp or m.heads % lay.tp or (m.kv_heads or m.heads) % lay.tp
            or a.seq % (lay.cp * lay.tp) or (lay.cp > 1 and a.seq % (2 * lay.cp))
            or a.batch % (lay.data_parallel * lay.passes)):
        p.error(f"the layout {lay.pp}x{lay.dp_replicate}x{lay.dp_shard}x{lay.cp}x{lay.ep}x{lay.tp} does not "
                "divide the model (heads and key-value heads by tp, layers by pp, the sequence by cp x tp and "
                "into 2 x cp chunks, the batch by the data-parallel ranks and micro-batches)")
    with open(a.hardware) as f:
        hw = Hardware(**json.load(f))
    pol = Policy(param=a.bytes, compute=a.bytes, reduce=a.bytes, state=a.bytes)
    out = predict(m, lay, pol, hw, a.batch, a.seq)
    print(json.dumps({"peak_memory": out["peak_memory"], "memory_rank0": out["memory"][0],
                      "step": out["step"], "tokens_per_gpu": out["tokens_per_gpu"], "mfu": out["mfu"]},
                     indent=1))


if __name__ == "__main__":
    sys.exit(main())
