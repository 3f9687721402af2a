"""The ring-attention program's counts, from the program itself, and the formulas they must meet.

The program (``book/programs/ring_attention.py``) is imported with
:func:`ddpguide.launch.programs.load`, afresh on each call: an edited program is what
the counts follow. What a run counted comes back in its ``--report`` file
(``run(..., report=True).report``: ``checks``, ``work`` and ``bytes``).

* Work under the causal mask, in block products of (S/N) x (S/N) (a block on the
  diagonal counts 1/2, the half a causal kernel computes): with the contiguous split
  rank r does r + 1/2, so the busiest rank does ``(2N-1)/N`` times the mean; with the
  head-tail split every rank does N/2.
* Bytes each rank sends, forward and backward, for local q, k, v of ``x`` bytes each:
  the ring sends k and v N-1 times forward and again backward, and the gradients of
  k and v N times (they return to their owner): ``(6N - 4) x``; Ulysses sends
  (N-1)/N of q, k, v and of the output forward, of their gradients backward:
  ``8 (N-1)/N x``. With grouped-query attention (g query heads share one key/value
  head, so k and v are x/g): the ring ``(6N - 4) x / g``, Ulysses ``(4 + 4/g) (N-1)/N x``.
"""

from __future__ import annotations

import os

from ddpguide.launch import programs

#: The chapter's program: its chunking and skipping rules are the ones counted here (no copy).
PROGRAM = "ring_attention.py"


def work_per_rank(world: int, split: str, causal: bool = True,
                  program: str | os.PathLike = PROGRAM) -> list[float]:
    """Block products each rank computes, from the program's own chunking and skipping rule."""
    source = programs.load(program)
    pieces = 1 if split == "contiguous" else 2
    work = []
    for rank in range(world):
        mine = source.chunks_of(rank, world, split)
        total = 0.0
        for step in range(world):
            theirs = source.chunks_of((rank - step) % world, world, split)
            for _, _, diagonal in source.block_pairs(mine, theirs, causal):
                total += (0.5 if diagonal else 1.0) / pieces ** 2
        work.append(total)
    return work


def busiest_over_mean(work: list[float]) -> float:
    return max(work) * len(work) / sum(work)


def contiguous_imbalance(world: int) -> float:
    """The formula: busiest rank over the mean, contiguous split, causal mask."""
    return (2 * world - 1) / world


def bytes_formula(method: str, world: int, local_bytes: int, groups: int = 1) -> float:
    """Bytes one rank sends in a forward and backward pass, for local q of ``local_bytes``
    and ``groups`` query heads per key/value head (1: multi-head attention; see the module
    docstring)."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if method in ("ring", "zigzag"):  # k, v (and their gradients) only: x / g each
        return (6 * world - 4) * local_bytes / groups
    if method == "ulysses":  # q, out, dout, dq: x each; k, v, dk, dv: x / g each
        return (4 + 4 / groups) * (world - 1) / world * local_bytes
    raise ValueError(f"unknown method {method!r}")
