"""What one optimizer step of train.py costs on a layout, predicted from the model's shapes
alone: the bytes every collective is given, the memory every rank holds, the step's FLOPs.
torch only; train.py --cost prints these beside what cost_meter.py counts in a step. The
prediction is for the run's dtype: with --bf16 the activations and their collectives are
smaller.

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


def predict_memory(c, layout, args, rank):
    """Bytes this rank holds: parameters (its shards), gradients (the same shapes), AdamW's
    two moments and a step counter per tensor, and the activations autograd keeps.

    Activations, in units of one rank's residual stream x (rows x tokens x dim), t = tp:
    each RMSNorm keeps its input and the normalised input (x/t each under sequence
    parallelism), and the next linear layer keeps that times the weight (x; gathered
    over the sequence under TP); attention keeps q (x/t), k and v (kv_heads / heads x/t
    each; every rank's under CP, cp times that), its output and the copy fed to wo (x/t
    each; with one head a rank and no CP that copy is a view); the MLP keeps the GELU's
    input and output (ffn x/t each); plus per-token statistics and the rotary tables.
    Under CP, each of a rank's two chunks of queries keeps its causal_lower_right mask,
    which SDPA makes on the CPU (bools; CUDA's kernels take the bias without one), but
    for a chunk that ends on the diagonal (cp rank 0's first, a plain causal square); no
    other attention mask exists (is_causal). The
    ends add the token ids, the final norm and the log-softmax of the logits (1/t of
    them under TP: loss_parallel never gathers them). A
    pipeline stage holds min(micro-batches, stages - stage) micro-batches at once under
    1F1B, all of them under GPipe. A checkpointed block keeps its input only.
    Under EP the rows a rank's experts get depend on the routing: the figure is the
    balanced share (a rank's tokens x top_k), the mean over the EP group (under a
    pipeline, a stage's peak over micro-batches routed unevenly is above it).
    With --bf16 the activations are bfloat16 but for what is kept in float32: the norms'
    input and output (an RMSNorm computes in float32) and the per-token statistics of the
    norms and of attention, the router's input and probabilities, the log-softmax.
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
    norm = 2 * x // t * F + x * A  # bytes: a norm computes in float32 at least
    kv = rows * seq * kv_dim(c)  # this rank's keys (and values), elements
    stats = 2 * rows * seq // t + rows * c.heads // t * seq  # rstd, log-sum-exp
    rotary = 4 * seq * c.dim // c.heads // 2  # cos, sin (of q and k)
    # q, attention's output and wo's input: a (heads, tokens) transposed copy of the output,
    # or CP's two chunks joined; with one head a rank and no CP the input is a view of it
    outputs = 2 if c.heads // t > 1 or cp > 1 else 1
    per_block = (x + 2 * cp * kv + outputs * x) // t + rotary
    # bytes: causal_lower_right's, for a chunk that does not end on the diagonal (rank 0's first)
    masks = (seq // 2) ** 2 * (2 * cp + 1 - (at["cp"] == 0)) if cp > 1 else 0
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
        per_block += 2 * c.ffn * x // t
    block = 2 * norm + per_block * A + stats * F + masks + moe
    if args.checkpoint_activations:  # a checkpointed block keeps its input, for the recompute
        block = x // t * A
    blocks = c.layers // layout.pp * block
    ends = rows * seq * 8 if first else 0  # the token ids
    if last:  # the final norm, the log-softmax of the logits (float32 at least), the loss
        ends += norm + rows * seq // t * F + (rows * seq * c.vocab // t + 1) * F
    return {"parameters": params * B, "gradients": params * B,
            "optimizer": (2 * params + count) * B, "activations": in_flight * (blocks + ends)}


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


def predict(config, layout, args):
    """The prediction for every rank: bytes by kind, memory; and the FLOPs of a step."""
    ranks = range(layout.world)
    return {"bytes": [predict_bytes(config, layout, args, r) for r in ranks],
            "memory": [predict_memory(config, layout, args, r) for r in ranks],
            "flops": flops(config, args)}
