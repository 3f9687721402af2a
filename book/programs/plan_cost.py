"""What a layout of a transformer costs per GPU, from first principles: the formulas. Memory
(memory: bytes a rank holds), compute (microbatch: seconds of a micro-batch's forward and backward),
collectives (collective: seconds of calls over some mesh axes). Run them as a step with plan_step.py,
plan_cost.py beside it (python plan_step.py --hardware hw.json --pp 2), which puts them in the order
torch runs a step: the calls each pass waits for, the forward a checkpointed backward runs again, what
overlaps, the parts of memory alive at once (at_peak). Inputs: the model's shapes, the layout and
the hardware (a data sheet, or plan_step.py --measure and --sweep), never a run of the layout
predicted. Source: the Ultra-Scale Playbook's accounting, torch's schedules and FSDP2, checked
against gpt/train.py --cost and torchtitan's, the Playbook's and picotron's runs. The standard
library only."""

import math
from dataclasses import dataclass, field

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
    engine: str = "torch"  # torch's pipelining, FSDP2, loss_parallel (train.py, torchtitan); or "nanotron"

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
    sweep: dict = field(default_factory=dict)  # the samples the links were fitted to (plan_step.py --sweep)
    # {kind: [[nodes, bytes/s], ...]}: bus bandwidth of a collective measured over every GPU of 1, 2,
    # 4... nodes, paid in place of the link's beta, sharing and burst (which the figure holds)
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
    """Bytes autograd keeps for one micro-batch on one stage (rows sequences of seq tokens on this
    rank, which is cp_rank on the cp axis). Per block, in units of the rank's residual stream
    x = rows x seq x dim, t = tp:
    - each RMSNorm keeps its input and its normalised input (x / t each under sequence parallelism;
      eager, in float32 at least, as torch's rms_norm upcasts; fused, its input only) and the next
      linear its gathered input (x);
    - attention keeps q, its output and wo's input (x / t each; with one head a rank and no CP, that
      input is a view of the output), and k and v (kv_heads / heads of x / t each, every cp rank's);
    - the MLP keeps its hidden activations (2 a GELU, 4 a SwiGLU, of ffn / dim x / t each); a
      mixture of experts its routed rows (below);
    - per-token statistics (the norms' rstd, attention's log-sum-exp: float32 at least) and the
      rotary tables. A causal kernel keeps no mask: m.mask keeps a seq x seq one; m.cp_mask a
      boolean one for each of a cp rank's two chunks of queries (zig-zag: chunks cp_rank and
      2 cp - 1 - cp_rank) that does not end on the diagonal.
    Full checkpointing keeps each block's input only. The ends: the token ids; the final norm and
    the log-softmax of the logits, float32 at least (1/t of them under loss_parallel)."""
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
    return total + head(m, lay, pol, rows, seq, stage)


def head(m: Model, lay: Layout, pol: Policy, rows: int, seq: int, stage: int) -> float:
    """What autograd keeps of the last stage's end: the final norm and its rstd, the log-softmax
    of the logits (float32 at least; 1/t of them under loss_parallel), the loss."""
    if stage != lay.pp - 1:
        return 0
    t, B = lay.tp, pol.compute
    F, x = max(B, 4), rows * seq * m.dim
    norm = (x // t * B if pol.fused else 2 * x // t * F) + x * B
    vocab = m.vocab // t if lay.loss_parallel else m.vocab
    return norm + rows * seq // t * F + (rows * seq * vocab + 1) * F


def root_parameters(m: Model, lay: Layout, stage: int) -> int:
    """Elements of a stage's parameters outside its blocks: the embedding, the final norm, an
    untied output layer (FSDP's root group)."""
    last = stage == lay.pp - 1
    return m.vocab // lay.tp * m.dim * ((stage == 0 or (last and m.tied)) + (last and not m.tied)) + m.dim * last


def memory(m: Model, lay: Layout, pol: Policy, batch: int, seq: int, rank: int = 0) -> dict:
    """Bytes one rank holds, by component, each at its largest during a step (plan_step.py's
    at_peak: the ones alive at once). fsdp_unsharded: FSDP's gathered weights as the backward
    starts (the root's own, never resharded, and the block in use; a pipeline keeps the stage
    gathered, gradients too); communication: DDP's buckets (a copy of every gradient) or FSDP's
    prefetched all-gather of the next block; temporaries: the loss's logits-sized gradients."""
    at = coordinates(lay, rank)
    stage = at["pp"]
    dense_n = lay.dp_shard * lay.cp * lay.ep if fsdp_on(lay) else 1
    dense_i = (at["dp_shard"] * lay.cp + at["cp"]) * lay.ep + at["ep"] if fsdp_on(lay) else 0
    exp_n = lay.dp_shard * lay.cp if fsdp_on(lay) else 1
    exp_i = at["dp_shard"] * lay.cp + at["cp"] if fsdp_on(lay) else 0
    params, count, whole = 0, 0, 0
    for r, c, kind in stage_parameters(m, lay, stage):
        n, i = (exp_n, exp_i) if kind == "expert" else (dense_n, dense_i)
        params += shards(r, n, i) * c
        whole += r * c
        count += 1
    per = -(-m.layers // lay.pp)  # the busiest stage's blocks
    root = root_parameters(m, lay, stage)
    block = (whole - root) / per
    rows = batch // lay.data_parallel // lay.passes
    act = in_flight(lay, stage) * activations(m, lay, pol, rows, seq // lay.cp, stage, at["cp"])
    split = lay.dp_replicate if lay.zero and dense_n == 1 else 1  # ZeRO-1 (no axis shards the weights)
    out = {"parameters": params * pol.param, "gradients": params * pol.param,
           "optimizer": (2 * params / split + count) * pol.state,  # AdamW's two moments, a step counter each
           "activations": act}
    unsharded, buffers = 0.0, 0.0
    # a shard group of one (PP x HSDP) copies too: fsdp/_fully_shard/_fsdp_param_group.py:447, world_size == 1
    if fsdp_on(lay) and (dense_n > 1 or (lay.pp > 1 and lay.engine == "torch")):
        if lay.pp > 1:  # reshard_after_forward=False: the stage stays gathered, grads too
            unsharded = whole * (pol.compute + pol.reduce)
        else:  # the root's weights and the block in use; the next block's all-gather
            unsharded, buffers = (root + block) * pol.compute, block * pol.compute * (per > 1)
    elif lay.dp_replicate > 1 and not fsdp_on(lay):
        buffers = params * pol.param  # DDP's buckets
    out["fsdp_unsharded"] = unsharded
    if pol.compute != pol.param and not fsdp_on(lay):
        out["fsdp_unsharded"] = whole * pol.compute  # a low-precision copy of the weights
    out["communication"] = buffers
    vocab = (m.vocab // lay.tp if lay.loss_parallel else m.vocab) * (stage == lay.pp - 1)  # the last stage's
    out["temporaries"] = loss_gradients(lay) * rows * seq // lay.cp * vocab * max(pol.compute, 4)
    return out


def loss_gradients(lay: Layout) -> int:
    """Logits-sized gradients the loss's backward holds; 3 under loss_parallel (tensor/parallel/loss.py:470, 518)."""
    return 3 if lay.tp > 1 and lay.loss_parallel and lay.engine == "torch" else 2


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
    seconds of its forward and backward compute at the rank's full speed, and the bytes it
    sends to the next stage (the collectives inside them, and the forward a checkpointed
    backward runs again: plan_step.py's microbatch_times). Each linear layer is three
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
    return {"forward": forward, "backward": backward, "send": tokens * d // t * B}
