"""Chapter 14 (N14.3): the memory formulas by attention kernel. The CPU's own kernel and
the math kernel (CUDA's for float64 and for grouped-query attention in float32), forced
on the CPU, keep exactly what cost_model.py predicts for them; the two differ, so the
check tells the kernels apart."""

from __future__ import annotations

import types

import pytest

from ddpguide.gpt.kernels import saved_by_kernel
from ddpguide.launch.programs import load

SHAPES = [{}, {"kv_heads": 2}, {"kv_heads": 1}, {"heads": 1}]


@pytest.mark.parametrize("kernel", ["cpu", "math"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=["MHA", "GQA", "MQA", "one head"])
def test_saved_bytes_equal_the_kernel_s_formula(kernel, dtype, shape):
    found = saved_by_kernel(kernel, dtype, dim=32, heads=shape.get("heads", 4), layers=2, seq=16,
                            **({"kv_heads": shape["kv_heads"]} if "kv_heads" in shape else {}))
    assert found["measured"] == found["predicted"], found


def test_the_math_kernel_keeps_more_than_the_cpu_s_formula_says():
    """The planted error: the math kernel's run measured against the CPU kernel's formula."""
    math = saved_by_kernel("math", dim=32, heads=4, layers=2, seq=16)
    cpu = saved_by_kernel("cpu", dim=32, heads=4, layers=2, seq=16)
    assert math["measured"] > cpu["predicted"] and math["predicted"] != cpu["predicted"]


def test_kernels_that_need_a_gpu_are_refused():
    with pytest.raises(ValueError, match="'flash' does not run on a CPU"):
        saved_by_kernel("flash")


def _args(**changes):
    return types.SimpleNamespace(**{"dtype": "float32", "bf16": False, **changes})


def test_the_kernel_sdpa_picks_on_cuda():
    """sdp_utils.cpp's order (flash, efficient, math) with the program's dtypes."""
    cost_model, model = load("gpt/cost_model.py"), load("gpt/model.py")
    mha, gqa = model.Config(), model.Config(kv_heads=2)
    pick = cost_model.attention_kernel
    assert [pick(mha, _args(), "cpu"), pick(mha, _args(bf16=True), "cpu")] == ["cpu", "cpu"]
    assert pick(mha, _args(bf16=True), "cuda") == pick(gqa, _args(bf16=True), "cuda") == "flash"
    assert pick(mha, _args(), "cuda") == "efficient"
    assert pick(gqa, _args(), "cuda") == pick(mha, _args(dtype="float64"), "cuda") == "math"
    assert pick(model.Config(dim=24, heads=4), _args(), "cuda") == "math"  # a head width of 6


def test_cuda_keeps_no_mask_and_the_fused_norm_s_state():
    """Under CP the CPU keeps causal_lower_right's bools, CUDA none; a norm keeps two
    float32 copies of x/t on the CPU, its input and nothing else of that size on CUDA."""
    cost_model, model, parallelize = (load(f"gpt/{n}.py") for n in ("cost_model", "model", "parallelize"))
    c = model.Config(dim=32, heads=4, layers=2, seq=16)
    args = types.SimpleNamespace(dtype="float32", bf16=False, batch=8, accumulate=1, microbatches=1,
                                 schedule="1F1B", checkpoint_activations=False, clip=1.0)
    layout = parallelize.Layout(cp=2)
    at = cost_model.coordinates(layout, 1)
    on = {d: cost_model._attention(c, layout, args, at, 8, 8, k) for d, k in (("cpu", "cpu"),
                                                                              ("cuda", "efficient"))}
    lse = {"cpu": 8 * 4 * 8 * 4, "cuda": 2 * 8 * 4 * 32 * 4}  # efficient: 32 rows a call at least
    masks = 4 * 8 + 4 * 12  # rank 1's chunks: 4 queries over 8 keys, over 12 keys
    assert on["cpu"] - lse["cpu"] - masks == on["cuda"] - lse["cuda"]
    cpu, cuda = (cost_model.predict_memory(c, parallelize.Layout(), args, 0, d, kernel="cpu")
                 for d in ("cpu", "cuda"))
    x = 8 * 16 * 32
    assert cpu["activations"] - cuda["activations"] == (2 * 2 + 1) * x * 4  # 2 norms a block, the final one
