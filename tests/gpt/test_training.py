"""Chapter 14, what a real run needs: gradient accumulation and clipping of the global
norm against one process, activation checkpointing and torch.compile (inductor, CPU)
against eager, bf16 mixed precision (FSDP2's policy) against float32."""

from __future__ import annotations

import pytest

from ddpguide.gpt.cost import parse
from ddpguide.gpt.layouts import check_options, compare, launch
from tests.gpt.test_cost import check_counted_bytes

TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return launch((), 1, tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One process on the batch of 16 that two accumulated halves of 8 make."""
    return launch((), 1, tmp_path_factory.mktemp("whole"), extra=check_options(batch=16))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks, layout", [(2, ("--pp", "2")), (4, ("--dp-shard", "2", "--tp", "2"))],
                         ids=["pp", "fsdp-tp"])
def test_two_accumulated_halves_equal_one_process_on_the_whole_batch(tmp_path, whole, ranks, layout):
    halves = launch(layout, ranks, tmp_path / "halves", extra=check_options(accumulate=2))
    assert max(compare(whole, halves)) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_clipping_is_active_in_the_checks(tmp_path, one):
    """Without it the run differs: the equivalence tests do check the clipped norm."""
    unclipped = launch((), 1, tmp_path / "unclipped", extra=check_options(clip=0))
    assert max(compare(one, unclipped)) > 1e-4


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks, layout", [(1, ()), (2, ("--dp-shard", "2"))], ids=["one", "fsdp"])
def test_activation_checkpointing_changes_nothing(tmp_path, one, ranks, layout):
    checkpointed = launch(layout, ranks, tmp_path / "ac", extra=check_options(checkpoint_activations=None))
    assert max(compare(one, checkpointed)) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks, layout", [(1, ()), (2, ("--dp-shard", "2"))], ids=["one", "fsdp"])
def test_compiled_blocks_equal_eager(tmp_path, one, ranks, layout):
    compiled = launch(layout, ranks, tmp_path / "compiled", extra=check_options(compile=None), timeout=600)
    assert max(compare(one, compiled)) <= TOLERANCE


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_bf16_mixed_precision_follows_float32_and_halves_the_gathers(tmp_path):
    """FSDP2 on 2 ranks, the default model, 10 steps, float32 and --bf16 (FSDP2's
    MixedPrecisionPolicy), both with --cost: every loss within 0.01 (not equal: bfloat16
    did run); the all-gathers put in half the bytes (parameters gathered in bfloat16), the
    reduce-scatters the same (gradients reduced in float32); counted = predicted for both."""
    real = ("--steps", "10", "--cost")
    float32 = launch(("--dp-shard", "2"), 2, tmp_path / "float32", extra=real)
    bf16 = launch(("--dp-shard", "2"), 2, tmp_path / "bf16", extra=(*real, "--bf16"))
    gap = max(abs(a - b) for a, b in zip(float32.losses, bf16.losses))
    assert 0 < gap <= 0.01, gap
    full, half = parse(float32.run), parse(bf16.run)
    for cost in (full, half):
        check_counted_bytes(cost, ("--dp-shard", "2"))
    for a, b in zip(full["counted"], half["counted"]):
        assert b["all_gather"] * 2 == a["all_gather"] > 0, (a, b)
        assert b["reduce_scatter"] == a["reduce_scatter"] > 0, (a, b)
