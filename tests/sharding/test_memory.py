"""Per-rank bytes of parameters, gradients and Adam state: counted, and the ZeRO paper's formulas."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from ddpguide.launch.spawn import spawn
from ddpguide.sharding import memory

matplotlib.use("Agg")
STRATEGIES = ("ddp", "zero1", "zero2_hand", "zero3_hand", "fsdp2")
_CACHE: dict[int, list[list[dict]]] = {}


def measured(world: int) -> list[list[dict]]:
    if world not in _CACHE:
        _CACHE[world] = spawn(memory.measure, world, STRATEGIES, timeout=300, echo=False)
    return _CACHE[world]


def test_formula_per_stage():
    n = 1000
    assert memory.formula(0, n, 4) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert memory.formula(1, n, 4) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert memory.formula(2, n, 4) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert memory.formula(3, n, 4) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    # 16 bytes per parameter on one rank, whatever the stage
    assert all(sum(memory.formula(s, n, 1).values()) == 16 * n for s in range(4))


@pytest.mark.parametrize("args, message", [
    ((4, 10, 2), "ZeRO stage must be 0, 1, 2 or 3, got 4"),
    ((1, 10, 0), "world_size must be a positive integer, got 0"),
    ((1, 10, 1.5), "world_size must be a positive integer, got 1.5"),
])
def test_formula_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        memory.formula(*args)


def _shapes(widths):
    shapes = []
    for a, b in zip(widths[:-1], widths[1:]):
        shapes += [(b, a), (b,)]
    return shapes


def _zero1_partition(numels, world):
    """ZeroRedundancyOptimizer's rule: largest tensor first, to the rank holding the fewest elements."""
    owner_sizes = [0] * world
    owners = {}
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        rank = owner_sizes.index(min(owner_sizes))
        owners[i] = rank
        owner_sizes[rank] += numels[i]
    return owners


def expected_bytes(strategy, widths, world, rank):
    """What rank `rank` must hold, computed from the shapes alone (float32, Adam, 4-byte step)."""
    shapes = _shapes(widths)
    numels = [math.prod(s) for s in shapes]
    tensors = len(shapes)
    if strategy == "ddp":
        local = sum(numels)
        return {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local + 4 * tensors,
                "optimizer_counters": 4 * tensors}
    if strategy == "zero1":
        owners = _zero1_partition(numels, world)
        mine = [i for i, r in owners.items() if r == rank]
        return {"params": 4 * sum(numels), "grads": 4 * sum(numels),
                "optimizer": 8 * sum(numels[i] for i in mine) + 4 * len(mine),
                "optimizer_counters": 4 * len(mine)}
    if strategy in ("zero2_hand", "zero3_hand"):
        shard = sum(-(-n // world) for n in numels)  # flat, padded shards
        params = 4 * shard * world if strategy == "zero2_hand" else 4 * shard
        return {"params": params, "grads": 4 * shard, "optimizer": 8 * shard + 4 * tensors,
                "optimizer_counters": 4 * tensors}
    # fsdp2: rows of dim 0 as torch.chunk gives them
    local = 0
    for shape in shapes:
        pieces = torch.arange(shape[0]).chunk(world)
        rows = len(pieces[rank]) if rank < len(pieces) else 0
        local += rows * math.prod(shape[1:])
    return {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local + 4 * tensors,
            "optimizer_counters": 4 * tensors}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_counted_bytes_are_exact(world):
    widths = memory.MEMORY_WIDTHS
    for rank, records in enumerate(measured(world)):
        assert [r["strategy"] for r in records] == list(STRATEGIES)
        for r in records:
            got = {k: r[k] for k in (*memory.KINDS, "optimizer_counters")}
            assert got == expected_bytes(r["strategy"], widths, world, rank), (world, rank, r["strategy"])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_even_split_matches_the_paper_up_to_adams_step_counters(world):
    # 4 x Linear(64, 64) splits evenly over 1, 2 and 4 ranks: measured - formula is exactly
    # Adam's 4-byte step counter per tensor this rank holds state for
    for records in measured(world):
        for r in records:
            measured_total = sum(r[k] for k in memory.KINDS)
            assert measured_total - sum(r["formula"].values()) == r["optimizer_counters"], r
            for kind in memory.KINDS:
                extra = r["optimizer_counters"] if kind == "optimizer" else 0
                assert r[kind] - extra == r["formula"][kind], (kind, r)


def test_table_and_plot():
    records = [r for world in (1, 2, 4) for rank in measured(world) for r in rank]
    rows = memory.table(records)
    assert len(rows) == 3 * len(STRATEGIES)
    fsdp4 = next(r for r in rows if r["strategy"] == "FSDP2" and r["ranks"] == 4)
    ddp4 = next(r for r in rows if r["strategy"] == "DDP" and r["ranks"] == 4)
    assert fsdp4["paper KiB"] * 4 == ddp4["paper KiB"]
    assert fsdp4["measured - paper (bytes)"] == fsdp4["Adam step counters (bytes)"] == 32
    figure = memory.plot(records)
    assert len(figure.axes[0].patches) == 3 * len(memory.KINDS) * len(STRATEGIES)
