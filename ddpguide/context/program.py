"""The ring-attention program, imported by path, and the formulas its counts must meet.

* Work under the causal mask, in block products of (S/N) x (S/N) (a block on the
  diagonal counts 1/2, the half a causal kernel computes): with the contiguous split
  rank r does r + 1/2, so the busiest rank does ``(2N-1)/N`` times the mean; with the
  head-tail split every rank does N/2.
* Bytes each rank sends, forward and backward, for local q, k, v of ``x`` bytes each:
  the ring sends k and v N-1 times forward and again backward, and the gradients of
  k and v N times (they return to their owner): ``(6N - 4) x``; Ulysses sends
  (N-1)/N of q, k, v and of the output forward, of their gradients backward:
  ``8 (N-1)/N x``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from types import ModuleType

from ddpguide.launch.programs import path_of

NAME = "ring_attention.py"


@functools.cache
def load() -> ModuleType:
    """``book/programs/ring_attention.py`` as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location("ring_attention_program", path_of(NAME))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path_of(NAME)} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def work_per_rank(world: int, split: str, causal: bool = True) -> list[float]:
    """Block products each rank computes, from the program's own chunking and skipping rule."""
    program = load()
    pieces = 1 if split == "contiguous" else 2
    work = []
    for rank in range(world):
        mine = program.chunks_of(rank, world, split)
        total = 0.0
        for step in range(world):
            theirs = program.chunks_of((rank - step) % world, world, split)
            for _, _, diagonal in program.block_pairs(mine, theirs, causal):
                total += (0.5 if diagonal else 1.0) / pieces ** 2
        work.append(total)
    return work


def busiest_over_mean(work: list[float]) -> float:
    return max(work) * len(work) / sum(work)


def contiguous_imbalance(world: int) -> float:
    """The formula: busiest rank over the mean, contiguous split, causal mask."""
    return (2 * world - 1) / world


def bytes_formula(method: str, world: int, local_bytes: int) -> float:
    """Bytes one rank sends in a forward and backward pass (see the module docstring)."""
    if method in ("ring", "zigzag"):
        return (6 * world - 4) * local_bytes
    if method == "ulysses":
        return 8 * (world - 1) / world * local_bytes
    raise ValueError(f"unknown method {method!r}")


_CHECK = re.compile(r"^check: (\w+) +(causal|no mask) *: .*: (OK|FAILED)$")
_WORK = re.compile(r"^causal work per rank, (\w+) .*: \[([^\]]*)\], busiest/mean ([\d.]+)$")
_BYTES = re.compile(r"^bytes sent per rank, (\w+) +forward \+ backward: \[([^\]]*)\]$")


def parse_output(lines: list[str]) -> dict:
    """The program's report: ``checks`` {(method, causal): passed}, ``work`` and ``bytes`` lists."""
    found: dict = {"checks": {}, "work": {}, "bytes": {}}
    for line in lines:
        if m := _CHECK.match(line):
            found["checks"][m[1], m[2] == "causal"] = m[3] == "OK"
        elif m := _WORK.match(line):
            found["work"][m[1]] = [float(x) for x in m[2].split(",")]
        elif m := _BYTES.match(line):
            found["bytes"][m[1]] = [int(x) for x in m[2].split(",")]
    return found
