"""'Fits' holds the allocator's headroom: torchtitan's reserved memory over the prediction."""

from __future__ import annotations

import statistics

import pytest

from ddpguide.plan import catalog, hardware, published, search


@pytest.fixture(scope="module")
def p():
    return search.program()


def test_headroom_is_torchtitans_reserved_over_predicted(p):
    rows = [r for r in published.compare(p) if r["source"] == "torchtitan"]
    expected = statistics.median(r["reported_gib"] / r["predicted_gib"] for r in rows)
    assert published.headroom(p) == expected and 1.1 < expected < 1.4


def test_a_layout_that_fits_without_headroom_does_not_with_it(p):
    """Llama 3 8B on 8 H100: the fastest layout that fits with no headroom only (over 90% of
    the memory) no longer fits with torchtitan's, and fewer layouts fit."""
    model, pol, hw = catalog.model(p, "llama3-8b"), catalog.policy(p, "bf16"), hardware.named(p, "h100")
    bare = search.rank(p, model, pol, hw, 8, 16, 8192)
    held = search.rank(p, model, pol, hw, 8, 16, 8192, headroom=published.headroom(p))
    first = next(r for r in bare if r["fits"] and r["peak_memory"] * published.headroom(p) > hw.memory)
    assert first["peak_memory"] > 0.9 * hw.memory
    again = next(r for r in held if r["name"] == first["name"])
    assert not again["fits"] and again["margin"] < 0 < first["margin"]
    assert again["margin"] == pytest.approx(hw.memory - first["peak_memory"] * published.headroom(p))
    assert held[0]["fits"]
    assert sum(r["fits"] for r in held) < sum(r["fits"] for r in bare)
