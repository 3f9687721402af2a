"""Bytes moved by the all-to-alls of expert parallelism, counted on real ranks.

For a balanced router with k = 1 every rank sends ``(N-1)/N`` of its tokens to
other ranks when it dispatches them and receives as many back when it combines
them: ``tokens x hidden x bytes x 2 x (N-1)/N`` per rank and forward pass, plus
the exchange of the counts (E/N integers to each other rank). The counter wraps
``torch.distributed.all_to_all_single`` (the function the program calls) and adds
up, for every call, the rows this rank sends to a rank other than itself.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from ddpguide.core.runtime import CPU_BACKEND
from ddpguide.launch import programs

#: The chapter's program: its layer, router and exchange are what is counted here (no copy).
PROGRAM = "moe_expert_parallel.py"


def formula(tokens: int, hidden: int, element_bytes: int, ranks: int) -> float:
    """Bytes one rank sends in the dispatch and the combine of a balanced router (k = 1)."""
    if ranks < 1 or tokens < 0 or hidden < 1 or element_bytes < 1:
        raise ValueError(f"formula needs ranks >= 1, tokens >= 0, hidden >= 1, bytes >= 1; got "
                         f"{ranks}, {tokens}, {hidden}, {element_bytes}")
    return tokens * hidden * element_bytes * 2 * (ranks - 1) / ranks


def sent_off_rank(tensor: torch.Tensor, in_splits, rank: int, ranks: int) -> int:
    """Bytes of ``tensor`` that one ``all_to_all_single`` sends to the other ranks."""
    rows = list(in_splits) if in_splits else [tensor.shape[0] // ranks] * ranks
    row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
    return sum(n for peer, n in enumerate(rows) if peer != rank) * row_bytes


@contextlib.contextmanager
def counting(log: list[dict]):
    """Within the block, every ``all_to_all_single`` appends ``{"bytes", "dtype", "rows"}``."""
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                async_op=False):
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        log.append({"bytes": sent_off_rank(input, input_split_sizes, rank, ranks),
                    "dtype": str(input.dtype).removeprefix("torch."),
                    "rows": list(input_split_sizes) if input_split_sizes else None})
        return original(output, input, output_split_sizes, input_split_sizes, group=group,
                        async_op=async_op)

    dist.all_to_all_single = counted
    try:
        yield log
    finally:
        dist.all_to_all_single = original


def balanced(layer, tokens: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Tokens that a router sends exactly evenly: token t to expert t mod E (k = 1).

    The router is set to read the first E features, and token t carries a spike
    on feature t mod E; the layer's norm keeps the spike the largest feature.
    """
    experts = layer.experts
    if hidden < experts or tokens % experts:
        raise ValueError(f"a balanced batch needs hidden >= E and tokens divisible by E; got "
                         f"hidden {hidden}, tokens {tokens}, E {experts}")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :experts] = torch.eye(experts, dtype=layer.router.weight.dtype)
        layer.router.bias.zero_()
    generator = torch.Generator().manual_seed(seed)
    x = 0.01 * torch.randn(tokens, hidden, generator=generator, dtype=torch.float64)
    x[torch.arange(tokens), torch.arange(tokens) % experts] += 10.0
    return x


def count_worker(tokens: int, hidden: int, ffn: int, experts: int,
                 program: str = PROGRAM) -> dict:
    """One rank: a forward and backward pass of a balanced batch, every all-to-all counted."""
    source = programs.load(program)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    local = experts // ranks
    layer = source.make_layer(hidden, ffn, experts, seed=0, first=rank * local, count=local)
    x = balanced(layer, tokens, hidden, seed=rank)
    forward: list[dict] = []
    with counting(forward):  # dropless (capacity factor None)
        out = source.expert_parallel(layer, x, 1, None, None, ranks * tokens)
    backward: list[dict] = []
    with counting(backward):
        (out.y.square().sum() + out.aux).backward()
    counts = [c["bytes"] for c in forward if c["rows"] is None]
    rows = [c["bytes"] for c in forward if c["rows"] is not None]
    return {"forward": forward, "backward": backward, "counts_bytes": sum(counts),
            "token_bytes": sum(rows), "backward_bytes": sum(c["bytes"] for c in backward),
            "per_expert": out.received, "dropped": int((~out.keep).sum()),
            "formula": formula(tokens, hidden, x.element_size(), ranks)}


def count(ranks: int, tokens: int = 64, hidden: int = 16, ffn: int = 32, experts: int = 4,
          timeout: float = 180.0, program: str = PROGRAM) -> list[dict]:
    """:func:`count_worker` on ``ranks`` spawned ranks; each rank's result, in rank order."""
    from ddpguide.launch.spawn import spawn

    if experts % ranks:
        raise ValueError(f"{experts} experts do not split evenly over {ranks} ranks")
    return spawn(count_worker, ranks, tokens, hidden, ffn, experts, program, timeout=timeout,
                 echo=False, backend=CPU_BACKEND)
