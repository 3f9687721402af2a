"""The program's layer in one process: where torch._grouped_mm runs (and its refusals, word for
word), the grouped experts against the loop, the bias that chooses but does not weigh, its
update's sign, the z-loss and the float32 router."""

from __future__ import annotations

import pytest
import torch

from ddpguide.launch.programs import load

NAME = "moe_expert_parallel.py"


@pytest.fixture(scope="module")
def moe():
    return load(NAME)


@pytest.mark.parametrize("dtype, width, refusal", [
    (torch.float32, 16, None),
    (torch.bfloat16, 16, None),
    (torch.float16, 8, None),
    (torch.float64, 16, "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"),
    (torch.float32, 3, "strides should be multiple of 16 bytes"),
    (torch.bfloat16, 4, "strides should be multiple of 16 bytes"),
])
def test_grouped_mm_takes_says_what_the_kernel_does(moe, dtype, width, refusal):
    rows, w = torch.zeros(7, width, dtype=dtype), torch.zeros(3, width, 16, dtype=dtype)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    assert moe.grouped_mm_takes(rows, w) == (refusal is None)
    if refusal is None:
        assert torch._grouped_mm(rows, w, offs=offs).shape == (7, 16)
    else:
        with pytest.raises(RuntimeError, match=refusal):
            torch._grouped_mm(rows, w, offs=offs)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 0.05),
                                              (torch.float64, 0.0)])
def test_the_local_experts_equal_the_loop_with_an_empty_expert(moe, dtype, tolerance):
    """Grouped (float32, bfloat16) or one by one (float64): output and every gradient."""
    torch.manual_seed(0)
    layer = moe.MoE(16, 32, 4, first=4, count=3).to(dtype)  # experts 4, 5, 6 of some rank
    rows = torch.randn(9, 16, dtype=dtype, requires_grad=True)
    weights = torch.randn(9, 16, dtype=dtype)
    counts = [5, 0, 4]
    got = []
    for grouped in (True, False):
        out = (layer.local_experts(rows, counts) if grouped else
               torch.cat([layer.expert(4 + e, part) for e, part in enumerate(rows.split(counts))]))
        (out * weights).sum().backward()
        got.append([out.detach().double(), rows.grad.double(), layer.w_in.grad.double(),
                    layer.w_out.grad.double()])
        rows.grad = layer.w_in.grad = layer.w_out.grad = None
    for a, b in zip(*got):
        assert (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item())
    assert got[0][2][1].abs().max() == 0  # the expert without rows gets no gradient


def test_the_bias_chooses_the_expert_but_not_the_gate(moe):
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]], dtype=torch.float64)
    gate, expert, keep = moe.route(probs, 1, None, torch.tensor([-0.4, 0.0, 0.0],
                                                                 dtype=torch.float64))
    assert expert.tolist() == [[1], [1]] and keep.all()  # dropless: every choice kept
    assert gate.tolist() == [[0.3], [0.6]]  # the probabilities, without the bias
    # capacity 1: token 1 takes expert 1 first, so token 0's second choice (expert 1) is dropped
    gate, expert, keep = moe.route(probs, 2, capacity=1)
    assert expert.tolist() == [[0, 1], [1, 2]] and keep.tolist() == [[True, False], [True, True]]


def test_the_bias_falls_for_a_busy_expert_and_rises_for_an_idle_one(moe):
    layer = moe.MoE(4, 8, 3)
    moe.update_bias(layer, torch.tensor([6.0, 3.0, 0.0]), rate=0.25)
    assert layer.expert_bias.tolist() == [-0.25, 0.0, 0.25]
    assert "expert_bias" in layer.state_dict() and "expert_bias" not in dict(layer.named_parameters())


def test_the_z_loss_and_the_router_in_float32(moe):
    logits = torch.tensor([[0.0, 0.0], [3.0, 1.0]], dtype=torch.float64)
    expected = torch.logsumexp(logits, 1).square().sum()
    assert moe.z_loss_sum(logits) == expected
    layer = moe.MoE(16, 32, 4).to(torch.bfloat16)
    logits, probs = moe.router(layer, torch.randn(5, 16, dtype=torch.bfloat16))
    assert (logits.dtype, probs.dtype) == (torch.bfloat16, torch.float32)
    assert moe.router(layer.double(), torch.randn(5, 16, dtype=torch.float64))[1].dtype == torch.float64


def test_capacity_none_is_dropless(moe):
    assert moe.capacity_of(16, 4, 2, None) is None
    assert moe.capacity_of(16, 4, 2, 1.0) == 8
