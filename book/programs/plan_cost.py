"""What a layout of a transformer costs per GPU, from first principles: memory and step time.

Run:  python plan_cost.py --measure hw.json          (this machine's matmul rates and overhead)
      torchrun --standalone --nproc-per-node 4 plan_cost.py --sweep hw.json   (alpha, beta)
      python plan_cost.py --hardware hw.json --layers 2 --dim 256 --tp 2 --dp-shard 2

Inputs are of three kinds and nothing else: the model's shapes, the layout, and the hardware
(data-sheet figures, or microbenchmarks: matmul rate per shape, alpha and beta of each link
level from a collective sweep, the time of one small operation). No input comes from a run
of the layout predicted. torch and the standard library only.

Source: the Ultra-Scale Playbook's memory and time accounting ("Finding the best training
configuration"), checked against the capstone GPT (gpt/train.py --cost) and torchtitan's
published Llama 3.1 runs; no seed article covers it.
"""

import argparse
import json
import math
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
    mask: bool = True  # attention with an explicit (seq x seq) mask, full scores computed

    @property
    def kv_dim(self):
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
    loss_parallel: bool = False  # logits stay split over tp (train.py gathers them)

    @property
    def world(self):
        return math.prod(getattr(self, a) for a in AXES)

    @property
    def data_parallel(self):
        return self.dp_replicate * self.dp_shard * self.ep


@dataclass
class Hardware:
    name: str = "cpu"
    peak: float = 1e11  # dense FLOP/s of the compute dtype (data sheet, or measured)
    peak_float8: float = 0.0
    memory: float = 24 * 2**30  # bytes a GPU (a rank) may hold
    bandwidth: float = 1e10  # memory bytes/s (element-wise work, the optimizer)
    gpus_per_node: int = 8
    links: dict = field(default_factory=lambda: {"node": [1e-5, 1e-10], "net": [1e-5, 1e-9]})
    op_seconds: float = 0.0  # one small operation issued from Python (or one kernel launch)
    collective_seconds: float = 0.0  # per collective call, beyond alpha
    matmul: list = field(default_factory=list)  # measured [m, k, n, FLOP/s] a rank
    ceiling: float = 1.0  # the best matmul rate / peak (MAMF) where no shape was measured
    attention: float = 0.0  # FLOP/s of the attention kernel (0: as a matmul of its shape)
    overlap: bool = True  # collectives on their own engine: FSDP and DDP hide behind compute
    cores: int = 0  # CPU: ranks of a node share these cores (0: a device each)
    sources: dict = field(default_factory=dict)


def matmul_rate(hw, m, k, n, float8=False):
    """FLOP/s of one (m x k) @ (k x n): the nearest measured shape (in log space), else a
    roofline: the ceiling's FLOP/s or the bytes over the memory bandwidth, the slower."""
    if hw.matmul:
        def distance(row):
            return sum(math.log(a / b) ** 2 for a, b in zip(row[:3], (m, k, n)))
        return min(hw.matmul, key=distance)[3]
    peak = (hw.peak_float8 if float8 and hw.peak_float8 else hw.peak) * hw.ceiling
    flops, moved = 2 * m * k * n, 2 * (m * k + k * n + m * n)
    return flops / max(flops / peak, moved / hw.bandwidth)


def shards(rows, ranks, index):
    """Rows of a dim-0 shard under FSDP2 (padded to a multiple of the ranks: ceil each)."""
    per = -(-rows // ranks)
    return max(0, min(per, rows - index * per))


def coordinates(lay, rank):
    out = {}
    for axis in reversed(AXES):
        size = getattr(lay, axis)
        out[axis], rank = rank % size, rank // size
    return out


def fsdp_on(lay):
    return lay.dp_shard * lay.cp * lay.ep > 1 or (lay.dp_replicate > 1 and (lay.tp > 1 or lay.pp > 1))


def stage_parameters(m, lay, stage):
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


def in_flight(lay, stage):
    """Micro-batches whose activations a stage holds at once."""
    if lay.pp == 1:
        return 1
    if lay.schedule == "GPipe":
        return lay.microbatches
    if lay.schedule == "Interleaved1F1B":  # warm-up of two chunks, each half a stage
        return min(lay.microbatches, (lay.pp + 2 * (lay.pp - 1 - stage) + 1) / 2)
    return min(lay.microbatches, lay.pp - stage)


def activations(m, lay, pol, rows, seq, stage):
    """Bytes autograd keeps for one micro-batch on one stage (rows sequences of seq tokens
    on this rank). Per block, in units of the rank's residual stream x = rows x seq x dim:
    each RMSNorm keeps its input and its normalised output (x / tp each under sequence
    parallelism) and the next linear its gathered input (x); attention keeps q, its
    output and wo's input (x / tp each) and k, v (gathered over cp); the MLP its hidden
    activations (2 a GELU, 4 a SwiGLU, of ffn / dim x each); small per-token statistics,
    rotary tables and the mask. Full checkpointing keeps each block's input only."""
    t, cp, B = lay.tp, lay.cp, pol.compute
    x = rows * seq * m.dim
    kv = rows * seq * m.kv_dim * cp
    norm = 2 * x // t + x
    small = (2 * rows * seq // t + rows * m.heads // t * seq
             + 4 * seq * m.dim // m.heads // 2 + (seq * seq * cp if m.mask else 0))
    hidden = (4 if m.gated else 2) * rows * seq * m.ffn // t
    per_block = 2 * norm + 3 * x // t + 2 * kv // t + small
    if m.experts:
        routed = rows * seq * m.top_k
        per_block += routed * (2 * m.dim + (4 if m.gated else 2) * m.ffn)
        per_block += rows * seq * (m.experts + 4 * m.top_k) + m.shared * hidden
    else:
        per_block += hidden
    if lay.ac == "full":
        per_block = x // t
    elif lay.ac == "selective":  # every other block recomputed (torchtitan's layer option)
        per_block = (per_block + x // t) / 2
    total = -(-m.layers // lay.pp) * per_block * B
    if stage == 0:
        total += rows * seq * 8  # the token ids
    if stage == lay.pp - 1:
        vocab = m.vocab // t if lay.loss_parallel else m.vocab
        total += (norm + rows * seq * vocab + 1) * B + rows * seq * vocab * 4 * (B < 4)
    return total


def memory(m, lay, pol, batch, seq, rank=0):
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
    rows = batch // lay.data_parallel // (lay.microbatches if lay.pp > 1 else 1)
    act = in_flight(lay, stage) * activations(m, lay, pol, rows, seq // lay.cp, stage)
    out = {"parameters": params * pol.param, "gradients": params * pol.param,
           "optimizer": (2 * params + count) * pol.state,  # AdamW's two moments, a step counter each
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


def ring(kind, n):
    """(messages in a row, bytes on the wire per byte of the whole tensor) of a ring."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "send_recv":
        return 1, 1.0
    return n - 1, (n - 1) / n  # all-gather, reduce-scatter, all-to-all


def link(hw, lay, axes):
    """The link level a group over these mesh axes crosses: 'net' if its ranks are on more
    than one node (the mesh is laid out with tp innermost, as torchrun numbers ranks)."""
    inner = 1
    for axis in reversed(AXES):
        size = getattr(lay, axis)
        if axis in axes and size > 1 and inner * size > hw.gpus_per_node:
            return "net"
        inner *= size
    return "node"


def collective(hw, lay, kind, whole_bytes, axes, calls=1):
    """Seconds of `calls` collectives, each over a whole tensor of whole_bytes, on the group
    of these mesh axes: alpha per message in a row, beta per byte on the wire, plus the
    per-call overhead."""
    n = math.prod(getattr(lay, a) for a in axes)
    if n == 1 or whole_bytes == 0:
        return 0.0
    alpha, beta = hw.links[link(hw, lay, axes)]
    steps, wire = ring(kind, n)
    return calls * (alpha * steps + hw.collective_seconds) + beta * wire * whole_bytes


def step(m, lay, pol, hw, batch, seq):
    """Seconds of one optimizer step on the busiest rank, by part. The overlap rule: with
    hw.overlap, FSDP's gathers and reductions and DDP's all-reduce run beside compute and
    only what exceeds it shows (plus the first gather); TP, CP, EP collectives and the
    pipeline's sends are always in the way."""
    t, cp = lay.tp, lay.cp
    mb = lay.microbatches if lay.pp > 1 else 1
    rows = batch // lay.data_parallel // mb
    tokens = rows * seq // cp  # this rank's tokens in one micro-batch
    per = -(-m.layers // lay.pp)  # the busiest stage's blocks
    f8 = pol.float8
    share = 1.0
    if hw.cores:  # ranks of a node share its cores: each runs at cores / ranks of the rate
        share = max(1.0, min(lay.world, hw.gpus_per_node) / hw.cores)

    def mm(a, b, c):  # forward and the two backward matmuls
        return share * sum(2 * x * y * z / matmul_rate(hw, x, y, z, f8) for x, y, z in
                           ((a, b, c), (a, c, b), (b, a, c)))
    d, h = m.dim, m.ffn
    block = mm(tokens, d, d // t) * 2 + mm(tokens, d, m.kv_dim // t) * 2
    mlp = mm(tokens, d, h // t) * (3 if m.gated else 2)
    if m.experts:
        routed = tokens * m.top_k // max(1, m.experts // lay.ep) * lay.ep  # rows an expert gets
        block += mm(routed, d, h) * (3 if m.gated else 2) * (m.experts // lay.ep) + mlp * m.shared
        block += mm(tokens, d, m.experts)
    else:
        block += mlp
    hd, span = d // m.heads, seq if m.mask else seq // 2  # a mask: every score computed
    attn_flops = 3 * 4 * rows * m.heads // t * (seq // cp) * span * hd  # q k^T, p v; backward 2x
    attn = share * attn_flops / (hw.attention or matmul_rate(hw, seq // cp, hd, span))
    ops = 40 * (1 + (lay.ac != "none")) + 30 * (t > 1) + 10 * (cp > 1) + 20 * bool(m.experts)
    # element-wise work (norms, activations, rotary, casts) reads and writes about what
    # autograd would keep without checkpointing, once forward and twice backward
    plain = Layout(**{**asdict(lay), "ac": "none"})
    elementwise = share * 3 * activations(m, plain, pol, rows, seq // cp, -1) / max(per, 1) / hw.bandwidth
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[lay.ac] / 3
    per_block = (block + attn) * (1 + recompute) + elementwise + ops * hw.op_seconds * share
    head = mm(tokens, d, m.vocab // t)  # the last stage's: the busiest rank
    compute_mb = per * per_block + head
    # communication of one micro-batch, exposed
    x_bytes = tokens * d * pol.compute
    fwd = 1 + (lay.ac != "none")
    exposed = 0.0
    exposed += collective(hw, lay, "all_gather", x_bytes, ("tp",), per * 2 * (fwd + 1))
    exposed += collective(hw, lay, "reduce_scatter", x_bytes, ("tp",), per * 2 * (fwd + 1))
    kv_bytes = rows * seq * m.kv_dim // t * pol.compute
    exposed += collective(hw, lay, "all_gather", kv_bytes, ("cp",), per * 2 * fwd)
    exposed += collective(hw, lay, "reduce_scatter", kv_bytes, ("cp",), per * 2)
    if m.experts:
        sent = tokens * m.top_k * d * pol.compute
        exposed += 2 * (fwd + 1) * per * collective(hw, lay, "all_to_all", sent * lay.ep, ("ep",))
    p2p = collective(hw, lay, "send_recv", x_bytes / t, ("pp",), 2) if lay.pp > 1 else 0.0
    # the pipeline: (micro-batches + stages - 1) slots of one micro-batch's forward+backward
    slots = mb + lay.pp - 1
    if lay.schedule == "Interleaved1F1B" and lay.pp > 1:
        slots = mb + (lay.pp - 1) / 2
    compute = slots * compute_mb
    in_the_way = slots * (exposed + p2p)
    # data parallelism over the whole step
    stage_params = sum(r * c for r, c, _ in stage_parameters(m, lay, 0))
    block_bytes = stage_params / max(per, 1)
    fsdp = 0.0
    if fsdp_on(lay):
        axes = ("dp_shard", "cp", "ep")
        gathers = 2 if lay.pp == 1 else 1
        ag = collective(hw, lay, "all_gather", block_bytes * pol.compute, axes, per * gathers)
        rs = collective(hw, lay, "reduce_scatter", block_bytes * pol.reduce, axes, per)
        fsdp = ag + rs
        if lay.dp_replicate > 1:
            fsdp += collective(hw, lay, "all_reduce", stage_params * pol.reduce / math.prod(
                getattr(lay, a) for a in axes), ("dp_replicate",), per)
        if hw.overlap:
            fsdp = max(0.0, fsdp - compute) + ag / (per * gathers)
    elif lay.dp_replicate > 1:
        total = stage_params * pol.reduce
        buckets = max(1, math.ceil(total / (25 * 2**20)))
        fsdp = collective(hw, lay, "all_reduce", total, ("dp_replicate",), buckets)
        if hw.overlap:
            fsdp = max(fsdp / buckets, fsdp - compute)
    local = memory(m, lay, pol, batch, seq)["parameters"] / pol.param
    optimizer = local * (pol.param * 2 + pol.state * 4) / hw.bandwidth * (share if hw.cores else 1)
    optimizer += 8 * hw.op_seconds * len(stage_parameters(m, lay, 0)) * share
    parts = {"compute": compute, "bubble": compute * (slots - mb) / slots if slots else 0.0,
             "tp_cp_ep_pp": in_the_way, "data_parallel": fsdp, "optimizer": optimizer}
    parts["total"] = compute + in_the_way + fsdp + optimizer
    return parts


def flops(m, batch, seq):
    """Model FLOPs of a step: 6 x matmul parameters per token plus attention (12 x layers x
    dim x seq per token; the causal half without a mask)."""
    h = m.ffn * (3 if m.gated else 2) * m.dim
    mlp = h * (m.top_k + m.shared) + m.dim * m.experts if m.experts else h
    per_layer = 2 * m.dim * m.dim + 2 * m.dim * m.kv_dim + mlp
    params = m.layers * per_layer + m.vocab * m.dim
    attn = 12 * m.layers * m.dim * seq * (1 if m.mask else 0.5)
    return batch * seq * (6 * params + attn)


def predict(m, lay, pol, hw, batch, seq):
    """The whole prediction: memory of each stage's busiest rank, the step and its parts,
    tokens/s a GPU and MFU against the data-sheet peak."""
    per_stage = lay.world // lay.pp  # each stage's first rank holds the largest (ceil) shards
    mems = [memory(m, lay, pol, batch, seq, stage * per_stage) for stage in range(lay.pp)]
    s = step(m, lay, pol, hw, batch, seq)
    peak = hw.peak_float8 if pol.float8 and hw.peak_float8 else hw.peak
    tokens = batch * seq / s["total"] / lay.world
    return {"memory": mems, "peak_memory": max(sum(x.values()) for x in mems), "step": s,
            "tokens_per_gpu": tokens, "mfu": flops(m, batch, seq) / s["total"] / lay.world / hw.peak,
            "peak_used": peak}


def measure(path, threads=1, seconds=0.1):
    """This machine's matmul rate per shape (one thread, as each rank runs), its memory
    bandwidth and the time of one small operation: written to path (JSON)."""
    torch.set_num_threads(threads)

    def timed(fn):
        fn()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
        return (time.perf_counter() - start) / n
    rows = []
    for m_ in (64, 256, 1024):
        for k in (16, 64, 256, 1024):
            for n in (16, 64, 256, 1024):
                a, b = torch.randn(m_, k), torch.randn(k, n)
                rows.append([m_, k, n, 2 * m_ * k * n / timed(lambda a=a, b=b: a @ b)])
    big = torch.randn(2**22)
    bandwidth = 2 * big.numel() * 4 / timed(lambda: big.mul(1.0001))
    tiny = torch.randn(8)
    op = timed(lambda: tiny.add(1.0))
    hw = Hardware(name="this-machine", peak=max(r[3] for r in rows), memory=os.sysconf("SC_PAGE_SIZE")
                  * os.sysconf("SC_PHYS_PAGES"), bandwidth=bandwidth, gpus_per_node=64,
                  op_seconds=op, matmul=rows, overlap=False, cores=os.cpu_count() or 1,
                  sources={"all": f"measured by plan_cost.py --measure, {time.strftime('%Y-%m-%d')}"})
    if os.path.exists(path):
        with open(path) as f:
            hw.links = json.load(f).get("links", hw.links)
    with open(path, "w") as f:
        json.dump(asdict(hw), f)


def sweep(path, sizes=(2**10, 2**14, 2**18, 2**21), repeats=5):
    """Under torchrun: all-reduces of each size on every rank; alpha and beta of the link
    fitted by least squares (time = alpha x 2(n-1) + beta x wire bytes); rank 0 adds them
    to path as the 'node' level (and 'net', which only a second node can measure)."""
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    samples = []
    for size in sizes:
        x = torch.zeros(size // 4)
        dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        samples.append((2 * (n - 1), 2 * (n - 1) / n * size, sorted(times)[len(times) // 2]))
    start = time.perf_counter()
    for _ in range(20):
        dist.barrier()
    barrier = (time.perf_counter() - start) / 20
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")):
        return
    sxx = sum(a * a for a, _, _ in samples)
    sxy = sum(a * b for a, b, _ in samples)
    syy = sum(b * b for _, b, _ in samples)
    sxt = sum(a * t for a, _, t in samples)
    syt = sum(b * t for _, b, t in samples)
    det = sxx * syy - sxy * sxy
    alpha, beta = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
    hw = json.load(open(path)) if os.path.exists(path) else asdict(Hardware())
    hw["links"] = {"node": [max(alpha, 0.0), beta], "net": [max(alpha, 0.0), beta]}
    hw["collective_seconds"] = max(0.0, barrier - 2 * max(alpha, 0.0))
    hw.setdefault("sources", {})["links"] = f"gloo all-reduce sweep on {n} ranks"
    with open(path, "w") as f:
        json.dump(hw, f)


def main(argv=None):
    p = argparse.ArgumentParser(prog="plan_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--measure", metavar="FILE")
    p.add_argument("--sweep", metavar="FILE")
    p.add_argument("--hardware", metavar="FILE")
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
    if a.measure:
        return measure(a.measure)
    if a.sweep:
        return sweep(a.sweep)
    if not a.hardware or not os.path.isfile(a.hardware):
        p.error("--hardware FILE: the hardware's figures (write them with --measure)")
    with open(a.hardware) as f:
        hw = Hardware(**json.load(f))
    m = Model(**{k: getattr(a, k) for k in asdict(Model())})
    lay = Layout(**{k: getattr(a, k) for k in asdict(Layout())})
    pol = Policy(param=a.bytes, compute=a.bytes, reduce=a.bytes, state=a.bytes)
    out = predict(m, lay, pol, hw, a.batch, a.seq)
    print(json.dumps({"peak_memory": out["peak_memory"], "memory_rank0": out["memory"][0],
                      "step": out["step"], "tokens_per_gpu": out["tokens_per_gpu"], "mfu": out["mfu"]},
                     indent=1))


if __name__ == "__main__":
    sys.exit(main())
