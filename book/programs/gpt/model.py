"""A small GPT: byte-level, decoder-only, rotary positions, grouped-query causal attention,
tied embeddings, and an optional mixture-of-experts MLP with a load-balancing loss.
torch only; train.py trains it on any layout.

The model knows two things about parallelism, both set by parallelize.py and both off
(None) in one process: the context-parallel group (each rank holds two chunks of every
sequence, zig-zag; the attention gathers every rank's keys and values over it, and the
mixture of experts counts a sequence's choices over it) and the expert-parallel group of
the mixture of experts (tokens travel to the rank that holds their expert and back).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import (
    all_gather_single_autograd,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class Config:
    vocab: int = 256  # bytes
    dim: int = 64
    heads: int = 4
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    layers: int = 4
    seq: int = 64
    ffn: int = 4  # the MLP's hidden width is ffn * dim
    experts: int = 0  # 0: a dense MLP in every block; E: a mixture of E experts
    top_k: int = 1  # experts per token
    renormalize: bool = False  # divide a token's top-k gates by their sum
    aux_loss: float = 0.01  # weight of the load-balancing loss (chapter 12), per MoE layer


def rotate(x, positions):
    """Rotary position embedding of x (batch, heads, tokens, head_dim) at these positions."""
    half = x.shape[-1] // 2
    wide = torch.promote_types(x.dtype, torch.float32)  # angles in bfloat16 would be far off
    freqs = 10000.0 ** (-torch.arange(half, dtype=wide, device=x.device) / half)
    angles = positions[:, None].to(wide) * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def zigzag(rank, ranks, seq):
    """The positions of a sequence of seq tokens that context-parallel rank `rank` holds:
    chunks rank and 2 ranks - 1 - rank of 2 ranks (chapter 11's zig-zag split), so that
    under the causal mask every rank has the same work. One rank: the whole sequence."""
    chunk = seq // (2 * ranks)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * ranks - 1 - rank)])


def gather_sequence(x, group):
    """All ranks' pieces of x (batch, heads, tokens, head_dim) along the tokens, in rank
    order; the backward pass reduce-scatters the gradient (torch gathers along dim 0 only)."""
    whole = wait_tensor(all_gather_single_autograd(x.transpose(0, 2).contiguous(), 0, group))
    return whole.transpose(0, 2)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.head_dim = c.dim // c.heads
        kv_dim = (c.kv_heads or c.heads) * self.head_dim
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, kv_dim, bias=False)
        self.wv = nn.Linear(c.dim, kv_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.cp_group = None  # context parallelism: this rank holds two chunks of the sequence
        # causal_lower_right(queries, keys) by shape, made once (torch 2.14.1 cannot make one
        # while a TorchDispatchMode is on, and cost_meter.py counts under one)
        self.bias = {}

    def forward(self, x):
        b, s, _ = x.shape  # under tensor parallelism wq gives this rank's heads only: view(-1)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if self.cp_group is None:
            positions = torch.arange(s, device=x.device)
            q, k = rotate(q, positions), rotate(k, positions)
            # enable_gqa: each group of heads / kv_heads query heads shares one key/value head
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = self.context_parallel(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def context_parallel(self, q, k, v):
        """Attention of this rank's two chunks of queries over the whole sequence's keys.

        Every rank gathers all ranks' keys and values (as Llama 3's context parallelism
        does; chapter 11's ring passes them around instead, and never holds them all) and
        puts them in sequence order; each chunk of queries attends to the keys up to its
        own end, causally aligned at its last token (causal_lower_right: no mask tensor,
        no score computed above the diagonal).
        """
        group = self.cp_group
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        chunk, seq = q.shape[2] // 2, q.shape[2] * ranks
        positions = zigzag(rank, ranks, seq).to(q.device)
        q, k = rotate(q, positions), rotate(k, positions)
        k, v = gather_sequence(k, group), gather_sequence(v, group)  # by rank: chunks r, 2N-1-r
        order = torch.cat([zigzag(r, ranks, seq) for r in range(ranks)]).argsort().to(q.device)
        k, v = k[:, :, order], v[:, :, order]  # in sequence order
        outs = []
        for i, c in enumerate((rank, 2 * ranks - 1 - rank)):
            end = (c + 1) * chunk
            if (chunk, end) not in self.bias:
                self.bias[chunk, end] = causal_lower_right(chunk, end)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :end], v[:, :, :end],
                attn_mask=self.bias[chunk, end], enable_gqa=True))
        return torch.cat(outs, dim=2)


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn * c.dim, bias=False)
        self.w2 = nn.Linear(c.ffn * c.dim, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Experts(nn.Module):
    """E expert MLPs as two stacked weights; under expert parallelism, this rank's E / ep."""

    def __init__(self, c: Config):
        super().__init__()
        hidden = c.ffn * c.dim
        self.w1 = nn.Parameter(torch.randn(c.experts, c.dim, hidden) * c.dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(c.experts, hidden, c.dim) * hidden ** -0.5)

    def forward(self, rows, counts):
        """rows sorted by expert, counts[e] of them for local expert e."""
        pieces = rows.split(counts)
        return torch.cat([F.gelu(p @ self.w1[e]) @ self.w2[e] for e, p in enumerate(pieces)])


class MoE(nn.Module):
    """Top-k routing, no capacity limit (no token is dropped, so any layout equals one
    process), with chapter 12's load-balancing loss counted per sequence."""

    def __init__(self, c: Config):
        super().__init__()
        self.n_experts, self.top_k, self.renormalize = c.experts, c.top_k, c.renormalize
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = Experts(c)
        self.ep_group = None  # expert parallelism: this rank holds experts[rank * E/ep ...]
        self.cp_group = None  # context parallelism: a sequence's tokens are on these ranks
        # the gradient of the load-balancing loss of one sequence; train.py sets it: the
        # weight aux_loss, over the sequences of a step, as the model's loss averages them
        self.aux_scale = 0.0

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        # the router in float32 at least (with --bf16 FSDP keeps its weight float32): in
        # bfloat16 the gates would be rounded to 3 digits and close experts tied
        wide = torch.promote_types(h.dtype, torch.float32)
        probs = torch.softmax(self.router(h.to(wide)), dim=-1)
        gate, expert = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            gate = gate / gate.sum(-1, keepdim=True)
        order = expert.reshape(-1).argsort(stable=True)  # choices sorted by expert
        token = order // self.top_k
        counts = torch.bincount(expert.reshape(-1), minlength=self.n_experts)
        if self.ep_group is None:
            done = self.experts(h[token], counts.tolist())
        else:
            done = self.expert_parallel(h[token], counts)
        weights = gate.reshape(-1)[order, None].to(done.dtype)
        out = torch.zeros_like(h).index_add(0, token, weights * done).view(shape)
        if self.aux_scale and torch.is_grad_enabled():
            balance = self.balance_loss(probs.view(*shape[:2], -1), expert.view(*shape[:2], -1))
            out = AddLoss.apply(out, balance, self.aux_scale)
        return out

    def balance_loss(self, probs, expert):
        """E sum_e f_e P_e of every sequence (chapter 12), summed over this rank's: f_e is
        the share of a sequence's choices that go to expert e, P_e the mean probability
        the router gives it. Per sequence, so that how a batch is cut (ranks, micro-batches)
        changes nothing; a sequence split over context-parallel ranks counts its choices on
        all of them (summed, no gradient), and each rank adds its own tokens' part of P_e."""
        choices = F.one_hot(expert, self.n_experts).sum((1, 2))  # (sequences, E)
        tokens = probs.shape[1]
        if self.cp_group is not None:
            dist.all_reduce(choices, group=self.cp_group)
            tokens *= dist.get_world_size(self.cp_group)
        f = choices.to(probs.dtype) / (self.top_k * tokens)
        return self.n_experts * (f * probs.sum(1) / tokens).sum()

    def expert_parallel(self, rows, counts):
        """Send the rows to the ranks of their experts, run the local experts, send them back."""
        group = self.ep_group
        ranks = dist.get_world_size(group)
        local = self.n_experts // ranks
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # (source rank, local expert)
        send = counts.view(ranks, local).sum(1).tolist()
        recv = received.view(ranks, local).sum(1).tolist()
        arrived = wait_tensor(all_to_all_single_autograd(rows, recv, send, group))
        label = torch.arange(local, device=rows.device).repeat(ranks).repeat_interleave(received)
        by_expert = label.argsort(stable=True)  # arrived by source rank, then expert: by expert
        done = self.experts(arrived[by_expert], received.view(ranks, local).sum(0).tolist())
        return wait_tensor(all_to_all_single_autograd(done[by_expert.argsort()], send, recv, group))


class AddLoss(torch.autograd.Function):
    """x unchanged; in the backward pass `loss` gets the gradient `scale`, as if scale x loss
    were added to the model's loss. A loss made inside a block reaches the backward pass
    this way under any layout, a pipeline stage that does not compute the final loss too."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale, ctx.dtype, ctx.device = scale, loss.dtype, loss.device
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.tensor(ctx.scale, dtype=ctx.dtype, device=ctx.device), None


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.dim)
        self.attn = Attention(c)
        self.mlp_norm = nn.RMSNorm(c.dim)
        self.mlp = MoE(c) if c.experts else MLP(c)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """The logits, with the embedding's weight (tied): no parameter of its own."""

    def forward(self, h, weight):
        return F.linear(h, weight)


class GPT(nn.Module):
    """Layers are named "0", "1", ...: a pipeline stage keeps its own and the names stay."""

    def __init__(self, c: Config):
        super().__init__()
        self.config = c
        self.tok_emb = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.RMSNorm(c.dim)
        self.head = Head()
        self.embeds = self.outputs = True  # a pipeline stage does one, both or neither
        nn.init.normal_(self.tok_emb.weight, std=c.dim ** -0.5)  # logits of unit size at first

    def forward(self, x):
        h = self.tok_emb(x) if self.embeds else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h), self.tok_emb.weight) if self.outputs else h


def loss_of(logits, targets):
    """The mean cross-entropy, in float32 at least (bfloat16 logits are widened)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
