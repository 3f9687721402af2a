"""What one optimizer step of train.py costs on a layout, predicted from the model's shapes
alone: the bytes every collective is given, the memory every rank holds, the step's FLOPs.
torch only; train.py --cost prints these beside what cost_meter.py counts in a step. The
prediction is for the run's dtype: with --bf16 the activations and their collectives are
smaller; and for its device: the kernels of a CPU and of CUDA keep different tensors for
the backward pass (predict_memory).

"Bytes sent" is, for every collective, the size of the tensor a rank puts in: the shard
it contributes to an all-gather, the whole tensor it offers to a reduce-scatter or an
all-reduce, the rows it hands to an all-to-all, the tensor it sends (send/recv). A ring
moves (n - 1) / n of that per step and an all-reduce twice that; the alpha-beta model
of the package applies those factors, the count does not. A group of one rank sends
nothing and is not counted.
"""

import math

import torch

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")

def kv_dim(c):
    """The width of the keys (and of the values): kv_heads heads of dim / heads each."""
    return (c.kv_heads or c.heads) * (c.dim // c.heads)


def _chunk(rows, ranks, index):
    """Rows of a dim-0 shard: FSDP2 pads dim 0 to a multiple of the ranks (ceil each)."""
    per = -(-rows // ranks)
    return per, max(0, min(per, rows - index * per))


def stage_parameters(c, layout, stage, bf16=False):
    """(name, local shape under TP, FSDP group) of every parameter a pipeline stage holds.

    Tensor parallelism splits wq, wk, wv, w1 by output rows (dim 0), wo, w2 by input
    columns (dim 1) and the embedding by vocabulary rows; norms stay whole. Each block is
    an FSDP group (its experts another, under EP); the root group holds the rest.
    """
    t, d, h, kv = layout.tp, c.dim, c.ffn * c.dim, kv_dim(c)
    per = c.layers // layout.pp
    params = []
    for i in range(stage * per, (stage + 1) * per):
        block = f"block{i}"
        params += [("attn_norm", (d,), block), ("mlp_norm", (d,), block), ("wq", (d // t, d), block)]
        params += [(w, (kv // t, d), block) for w in ("wk", "wv")] + [("wo", (d, d // t), block)]
        if c.experts:
            ep_group = f"experts{i}" if layout.ep > 1 else block
            params += [("router", (c.experts, d), f"router{i}" if bf16 else block),
                       ("w1", (c.experts // layout.ep, d, h), ep_group),
                       ("w2", (c.experts // layout.ep, h, d), ep_group)]
        else:
            params += [("w1", (h // t, d), block), ("w2", (d, h // t), block)]
    if stage in (0, layout.pp - 1):
        params.append(("tok_emb", (c.vocab // t, d), "root"))
    if stage == layout.pp - 1:
        params.append(("norm", (d,), "root"))
    return params


def coordinates(layout, rank):
    """This rank's place on the mesh (pp outermost, tp innermost, as parallelize.AXES)."""
    out = {}
    for axis in reversed(("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")):
        size = getattr(layout, axis)
        out[axis], rank = rank % size, rank // size
    return out


def _fsdp(layout, args):
    """Whether FSDP2 holds the parameters (parallelize.uses_fsdp)."""
    sharded = layout.dp_shard * layout.cp * layout.ep > 1
    return sharded or args.bf16 or (layout.dp_replicate > 1 and (layout.tp > 1 or layout.pp > 1))


def sizes(args):
    """Bytes of an element: of the parameters, gradients and optimizer state (the run's
    dtype), and of the activations (bfloat16 with --bf16)."""
    B = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    return B, 2 if args.bf16 else B


def predict_bytes(c, layout, args, rank):
    """Bytes this rank puts into each kind of collective in one optimizer step.

    All-to-all under EP: the rows a rank gets back depend on the routing; the figure is
    the mean over the EP group (which is exact: each row sent is received once). With
    --bf16 FSDP2 gathers the parameters in bfloat16 (the router's in float32) and reduces
    the gradients in float32; the activations and their gradients are bfloat16.
    """
    B, A = sizes(args)
    at = coordinates(layout, rank)
    stage, t, cp = at["pp"], layout.tp, layout.cp
    first, last = stage == 0, stage == layout.pp - 1
    per = c.layers // layout.pp
    rows = args.batch // layout.data_parallel  # sequences per rank per pass
    seq = c.seq // cp  # tokens of a sequence on this rank
    act_full, act_shard = rows * seq * c.dim * A, rows * seq // t * c.dim * A
    forwards = 2 if args.checkpoint_activations else 1  # a checkpointed block runs twice
    sent = dict.fromkeys(KINDS, 0)
    passes = args.accumulate  # forward and backward of the local batch, per step
    params = stage_parameters(c, layout, stage, args.bf16)

    if _fsdp(layout, args):
        n = layout.dp_shard * cp * layout.ep  # dense shards; experts over dp_shard x cp
        groups = {}
        for _, shape, group in params:
            ranks = n if not group.startswith("experts") else layout.dp_shard * cp
            padded, _ = _chunk(shape[0], ranks, 0)
            numel = padded * math.prod(shape[1:])
            shard, full, _, cast = groups.get(group, (0, 0, ranks, 0))
            groups[group] = (shard + numel, full + numel * ranks, ranks,
                             A if not group.startswith("router") else B)
        # outside a pipeline each group is gathered for forward and again for backward
        # (reshard_after_forward) in every accumulation step; a pipeline keeps it gathered
        # over the micro-batches of its one schedule a step. The gradients are reduced
        # once, after the last backward (set_requires_gradient_sync before it)
        gathers = 2 * passes if layout.pp == 1 else 1
        for shard, full, ranks, cast in groups.values():
            if ranks > 1:  # (a group of one rank, the experts' under --ep alone, sends nothing)
                sent["all_gather"] += gathers * shard * cast
                sent["reduce_scatter"] += full * B
            if layout.dp_replicate > 1:  # HSDP: the shard is all-reduced over the replicas
                sent["all_reduce"] += shard * B
    elif layout.dp_replicate > 1:  # DDP: every gradient, in buckets, after the last backward
        sent["all_reduce"] += sum(math.prod(s) for _, s, _ in params) * B

    if t > 1:
        # sequence parallelism: before each block's attention and MLP an all-gather of the
        # rank's piece of the sequence; after wo and w2 a reduce-scatter of the whole
        # partial sums; backward swaps them
        sent["all_gather"] += passes * per * (2 * forwards * act_shard + 2 * act_shard)
        # (a checkpointed block recomputes up to its last saved tensor: wo's reduce-scatter
        # again, not w2's, whose output nothing in the block keeps)
        sent["reduce_scatter"] += passes * per * (2 + (forwards - 1) + 2) * act_full
        if first:  # the vocabulary-split embedding: reduce-scatter; backward all-gather
            sent["reduce_scatter"] += passes * act_full
            sent["all_gather"] += passes * act_shard
        if last:  # the head gathers the sequence (backward: reduce-scatter); the logits
            # stay split by vocabulary: loss_parallel all-reduces three numbers a token
            # (the largest logit, the sum of exponentials, the target's logit)
            sent["all_gather"] += passes * act_shard
            sent["reduce_scatter"] += passes * act_full
            sent["all_reduce"] += passes * 3 * rows * seq * max(A, 4)
        # the norms' gradients are partial sums over tp (each rank saw its part of the
        # sequence): all-reduced once, by FSDP2 or by sum_partial_gradients
        sent["all_reduce"] += (2 * per + last) * c.dim * A  # (before FSDP2 casts them)
    if cp > 1:  # every block gathers K and V (forward), reduce-scatters their gradients
        kv = rows * seq * kv_dim(c) // t * A
        sent["all_gather"] += passes * per * 2 * forwards * kv
        sent["reduce_scatter"] += passes * per * 2 * cp * kv
    if cp > 1 and c.experts and c.aux_loss:  # the load-balancing loss: a sequence's choices
        # (int64, per expert) summed over its cp ranks, in every forward
        sent["all_reduce"] += passes * per * forwards * rows * c.experts * 8
    if layout.ep > 1:  # counts (int64), then rows out and back, forward and backward
        tokens = rows * seq * c.top_k * c.dim * A
        counts = c.experts * 8 * (args.microbatches if layout.pp > 1 else 1)  # per forward
        sent["all_to_all"] += passes * per * (forwards * (counts + 2 * tokens) + 2 * tokens)
    if layout.pp > 1:  # activations forward, their gradients backward, per micro-batch
        sent["send_recv"] += passes * act_shard * ((not last) + (not first))
        if first or last:  # the tied embedding's gradient, between first and last stage
            rows_emb = c.vocab // t
            if _fsdp(layout, args):
                n = layout.dp_shard * cp * layout.ep
                index = (at["dp_shard"] * cp + at["cp"]) * layout.ep + at["ep"]
                rows_emb = _chunk(rows_emb, n, index)[1]
            sent["all_reduce"] += rows_emb * c.dim * B
    if args.clip:
        sent["all_reduce"] += clip_bytes(c, layout, args, params, stage, B)
    if layout.data_parallel * cp > 1:  # the loss, one float64, averaged
        sent["all_reduce"] += 8
    if layout.pp > 1:  # and sent from the last stage to the others
        sent["all_reduce"] += 8
    return sent


def clip_bytes(c, layout, args, params, stage, B):
    """The gradient norm of train.py's clip_grad_norm: torch's get_total_norm takes each
    gradient's norm, and DTensor sums the vector of them (one entry per tensor) over every
    mesh dimension where a gradient is sharded (FSDP's and TP's); then the squared norms
    of the experts (one float64) are summed over "ep", and the total over "pp"."""
    experts = sum(1 for _, _, group in params if group.startswith("experts"))
    dense = len(params) - experts - (layout.pp > 1 and 0 < stage == layout.pp - 1)  # tied copy
    n = layout.dp_shard * layout.cp * layout.ep  # FSDP's shards of the dense weights
    sent = dense * B * ((_fsdp(layout, args) and n > 1) + (layout.tp > 1))
    if experts:
        sent += experts * B * (layout.dp_shard * layout.cp > 1) + 8
    return sent + 8 * (layout.pp > 1)


def _fsdp_index(layout, args, at, experts=False):
    """(shards, this rank's shard) of a parameter under FSDP; (1, 0) without it."""
    if not _fsdp(layout, args):
        return 1, 0
    if experts:
        return layout.dp_shard * layout.cp, at["dp_shard"] * layout.cp + at["cp"]
    n = layout.dp_shard * layout.cp * layout.ep
    return n, (at["dp_shard"] * layout.cp + at["cp"]) * layout.ep + at["ep"]


def attention_kernel(c, args, device="cpu"):
    """The kernel scaled_dot_product_attention runs for this model on this device type.

    On the CPU: "cpu" (its flash kernel; an explicit mask, causal_lower_right's made into
    bools, is kept for the backward pass). On CUDA, SDPA tries flash, then the
    memory-efficient kernel, then the math one (sdp_utils.cpp in PyTorch's repository, not
    shipped in the wheel; for a GPU of compute capability 8.0 or newer);
    causal_lower_right (nn/attention/bias.py) asks the same two and, where both decline,
    makes its mask and calls SDPA with it, which gets the math kernel. Flash takes only
    float16 and bfloat16 (--bf16); the efficient kernel takes float32 but not grouped-query
    attention (heads != kv_heads) and needs a head width that is a multiple of 4; float64
    and what both decline get "math".
    """
    if device != "cuda":
        return "cpu"
    head, gqa = c.dim // c.heads, (c.kv_heads or c.heads) != c.heads
    if args.bf16 and head <= 256:
        return "flash"
    if args.dtype == "float32" and not args.bf16 and not gqa and head % 4 == 0:
        return "efficient"
    return "math"


def _attention(c, layout, args, at, rows, seq, kernel):
    """Bytes one block's attention keeps for the backward pass, on one rank: q, k, v as the
    kernel keeps them, its output, the copy wo gets, its per-row statistics, its masks.

    The kernels' saved state is autograd's (derivatives.yaml): the CPU's flash, CUDA's flash
    and the efficient kernel keep query, key, value, output and a float32 log-sum-exp per
    query row, the efficient kernel's rounded up to a multiple of 32 rows per call (and
    flash's head width padded to a multiple of 8); the CPU's also keeps its mask. CUDA's
    flash returns its output laid out like the query, the efficient kernel's as (batch,
    tokens, heads, width): wo's input is then a view, not a copy (_meta_registrations.py).
    The math kernel (a composite of matmuls) keeps the scaled query, the scaled keys and the
    values expanded to every query head, and the weights (queries x keys per head), no mask
    and not its output (wo keeps it, or the copy it gets).
    """
    _, A = sizes(args)
    t, cp = layout.tp, layout.cp
    heads, kv_heads, width = c.heads // t, (c.kv_heads or c.heads) // t, c.dim // c.heads
    keys = seq * cp  # every rank's keys under CP (gathered), this rank's otherwise
    q = rows * seq * heads * width
    if cp > 1:  # (queries, keys) of each call: this rank's two chunks, each up to its end
        chunk = seq // 2
        calls = [(chunk, (i + 1) * chunk) for i in (at["cp"], 2 * cp - 1 - at["cp"])]
    else:
        calls = [(seq, seq)]
    copy = heads > 1 or cp > 1  # wo gets a (tokens, heads) copy of the output; else a view
    if kernel == "math":
        k = sum(rows * heads * n * width for _, n in calls)
        v = k if heads != kv_heads else rows * keys * heads * width  # one tensor, sliced
        weights = sum(rows * heads * m * n for m, n in calls)
        return (q + k + v + weights + q) * A  # wo's input: its output, or a copy of it
    pad = -(-width // 8) * 8 / width if kernel == "flash" else 1  # flash pads the head width
    kv = 2 * rows * keys * kv_heads * width
    if kernel == "efficient":
        copy = cp > 1  # (batch, tokens, heads, width): a view for wo unless CP joins chunks
        lse = sum(rows * heads * (-(-m // 32) * 32) for m, _ in calls)
    else:
        lse = rows * heads * seq
    masks = 0
    if kernel == "cpu" and cp > 1:  # causal_lower_right's bools, but for a chunk that ends on
        # the diagonal (cp rank 0's first, a plain causal square)
        masks = sum(m * n for m, n in calls if m != n)
    return int((q + kv + q) * pad + copy * q) * A + lse * max(A, 4) + masks


def _unsharded(c, layout, args, stage):
    """FSDP2's gathered parameters and their gradients before the reduce-scatter, at most
    at once on this rank (0 without FSDP2): each parameter's unsharded storage is its
    padded size (every rank's padded shard), in the dtype FSDP2 computes in.

    Outside a pipeline the root group (embedding, final norm) stays gathered from its
    forward to the end of the backward (the root is not resharded after forward); each
    block is gathered for its forward and again for its backward, where its gradients
    exist until its reduce-scatter: root + a block + its gradients (and the final norm's
    gradient, which the head's backward makes first), or, at the end, root and its
    gradients; under EP a block's experts, a group of their own, are reduced first. Under
    TP the embedding's gradient from its lookup comes back whole (every vocabulary row), tp
    times its gathered rows, until tie_gradients cuts it. (The block a backward prefetches
    waits in FSDP2's all-gather buffer, a communication buffer, not counted here.) Before
    the last of several accumulation steps every gradient is kept unsharded. A pipeline
    stage keeps all its groups gathered
    (reshard_after_forward=False) and its gradients too, until the schedule's last backward.
    """
    if not _fsdp(layout, args):
        return 0
    B, A = sizes(args)
    n = layout.dp_shard * layout.cp * layout.ep
    blocks, experts, root, norm = {}, {}, 0, 0  # bytes gathered: by block, its experts apart
    whole_emb = 0  # what the embedding's gradient holds beyond its gathered rows
    for name, shape, group in stage_parameters(c, layout, stage, args.bf16):
        ranks = n if not group.startswith("experts") else layout.dp_shard * layout.cp
        gathered = _chunk(shape[0], ranks, 0)[0] * ranks * math.prod(shape[1:])
        gathered *= B if group.startswith("router") else A
        if group == "root":
            root += gathered
            norm += gathered if name == "norm" else 0  # its gradient exists from the head on
            if name == "tok_emb" and stage == 0:  # under TP the lookup's gradient is whole
                whole_emb = (layout.tp - 1) * gathered
        else:
            index = int("".join(ch for ch in group if ch.isdigit()))
            part = experts if group.startswith("experts") else blocks
            part[index] = part.get(index, 0) + gathered
    whole = {i: blocks[i] + experts.get(i, 0) for i in blocks}
    if layout.pp > 1:
        return 2 * (root + sum(whole.values())) + whole_emb
    if args.accumulate > 1:  # the last micro-step's backward starts with every gradient kept
        # (the embedding's gradient kept between them is its gathered rows: counted so)
        return 2 * root + sum(whole.values()) + whole[max(whole)]
    # a block's experts (a group of their own under EP) are reduced and resharded before the
    # rest of the block's gradients exist
    peak = max(whole[i] + max(experts[i], blocks[i]) if i in experts else 2 * whole[i]
               for i in whole)
    return max(root + norm + peak, 2 * root + whole_emb)


def predict_memory(c, layout, args, rank, device="cpu", kernel=None):
    """Bytes this rank holds: parameters (its shards), gradients (the same shapes), AdamW's
    two moments and a step counter per tensor, the activations autograd keeps, and FSDP2's
    unsharded parameters and gradients at most at once (_unsharded). kernel: the attention
    kernel to assume (default: the one attention_kernel finds for the device).

    Activations, in units of one rank's residual stream x (rows x tokens x dim), t = tp:
    each RMSNorm keeps, on the CPU, its input and the normalised input (x/t each under
    sequence parallelism, float32 at least: the composite of torch's rms_norm); on CUDA
    rms_norm dispatches to _fused_rms_norm, which keeps its input (in its own dtype) and
    the float32 rstd (derivatives.yaml). The next linear layer keeps the norm's output (x;
    gathered over the sequence under TP). Attention keeps what _attention says, by the
    kernel attention_kernel picks; the MLP keeps the GELU's input and output (ffn x/t
    each); plus the norms' rstd and the rotary tables. The ends add the token ids, the
    final norm and the log-softmax of the logits (1/t of them under TP: loss_parallel never
    gathers them). A pipeline stage holds min(micro-batches, stages - stage) micro-batches
    at once under 1F1B, all of them under GPipe. A checkpointed block keeps its input only.
    Under EP the rows a rank's experts get depend on the routing: the figure is the
    balanced share (a rank's tokens x top_k), the mean over the EP group (under a
    pipeline, a stage's peak over micro-batches routed unevenly is above it).
    With --bf16 the activations are bfloat16 but for what is kept in float32: the per-token
    statistics, the router's input and probabilities, the log-softmax (and, on the CPU,
    the norms' input and output).
    """
    B, A = sizes(args)
    F = max(A, 4)  # float32 at least
    at = coordinates(layout, rank)
    stage, t, cp = at["pp"], layout.tp, layout.cp
    first, last = stage == 0, stage == layout.pp - 1
    params = 0
    count = 0
    for _, shape, group in stage_parameters(c, layout, stage, args.bf16):
        n, index = _fsdp_index(layout, args, at, experts=group.startswith("experts"))
        params += _chunk(shape[0], n, index)[1] * math.prod(shape[1:])
        count += 1
    rows = args.batch // layout.data_parallel
    in_flight = 1
    if layout.pp > 1:
        rows //= args.microbatches
        micro = args.microbatches * args.accumulate  # the schedule's micro-batches a step
        in_flight = micro if args.schedule == "GPipe" else min(micro, layout.pp - stage)
    seq = c.seq // cp
    x = rows * seq * c.dim  # elements
    kernel = kernel or attention_kernel(c, args, device)
    # bytes: a norm's own saved state, and the next linear layer's input
    norm = (2 * x // t * F if device != "cuda" else x // t * A) + x * A
    rstd = 2 * rows * seq // t  # the two norms' (float32 at least)
    rotary = 4 * seq * c.dim // c.heads // 2  # cos, sin (of q and k)
    moe = 0  # bytes of the mixture of experts
    if c.experts:
        # the routed rows in, every expert's hidden layer (in and out), its rows out, and the
        # gated rows index_add keeps; the router's input, probabilities and gates (float32 at least),
        # three int64 indices of the choices; the load-balancing loss's two per sequence
        choices = rows * seq * c.top_k
        moe = (choices * c.dim * (3 + 2 * c.ffn) * A + choices * A + x * (F - A)
               + rows * seq * c.experts * F + 3 * choices * 8
               + (2 * rows * c.experts * F if c.aux_loss else 0))
    else:
        moe = 2 * c.ffn * x // t * A
    block = (2 * norm + _attention(c, layout, args, at, rows, seq, kernel) + rotary * A
             + rstd * F + moe)
    if args.checkpoint_activations:  # a checkpointed block keeps its input, for the recompute
        block = x // t * A
    blocks = c.layers // layout.pp * block
    ends = rows * seq * 8 if first else 0  # the token ids
    if last:  # the final norm, the log-softmax of the logits (float32 at least), the loss
        ends += norm + rows * seq // t * F + (rows * seq * c.vocab // t + 1) * F
    return {"parameters": params * B, "gradients": params * B,
            "optimizer": (2 * params + count) * B, "activations": in_flight * (blocks + ends),
            "unsharded": _unsharded(c, layout, args, stage)}


def flops(c, args):
    """Model FLOPs of one optimizer step, all ranks together: 6 x (matmul parameters) x
    tokens (forward 2, backward 4 per parameter and token), plus attention's two matmuls
    (q k^T and the weights times v: 2 x 2 x seq x dim a token forward) times 3 for the
    backward: 12 x layers x dim x seq^2 per sequence. Attention is counted in full, as
    PaLM's and torchtitan's model FLOPs count it, though a causal kernel skips about half."""
    hidden = c.ffn * c.dim
    mlp = c.top_k * 2 * c.dim * hidden + c.dim * c.experts if c.experts else 2 * c.dim * hidden
    attention = 2 * c.dim * c.dim + 2 * c.dim * kv_dim(c)  # wq, wo; wk, wv
    matmul = c.layers * (attention + mlp) + c.vocab * c.dim  # the head is the embedding
    sequences = args.batch * args.accumulate
    return 6 * matmul * sequences * c.seq + 12 * c.layers * c.dim * c.seq ** 2 * sequences


def predict(config, layout, args, device="cpu"):
    """The prediction for every rank: bytes by kind, memory on this device type (and the
    attention kernel it assumes); and the FLOPs of a step."""
    ranks = range(layout.world)
    return {"bytes": [predict_bytes(config, layout, args, r) for r in ranks],
            "memory": [predict_memory(config, layout, args, r, device) for r in ranks],
            "flops": flops(config, args), "device": device,
            "attention": attention_kernel(config, args, device)}
