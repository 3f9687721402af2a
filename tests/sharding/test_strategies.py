"""The strategy table of the sharding chapter: names, layers, the one-process trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpguide.core.models import mlp
from ddpguide.sharding.strategies import (
    STRATEGIES,
    ZERO_STAGE,
    build,
    check_strategy,
    layers_with_parameters,
)


def test_an_unknown_strategy_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"^unknown strategy 'zero4': choose one of single, ddp, "
                                         r"zero1, zero2_hand, zero3_hand, fsdp2$"):
        check_strategy("zero4")
    assert set(ZERO_STAGE) == set(STRATEGIES)


def test_mlp_alternates_linear_layers_and_activations_and_checks_its_widths():
    model = mlp((4, 8, 3))
    assert [type(m) for m in model] == [nn.Linear, nn.Tanh, nn.Linear]
    assert layers_with_parameters(model) == [model[0], model[2]]
    with pytest.raises(ValueError, match=r"widths must be at least two positive integers, got \(4,\)"):
        mlp((4,))


def test_the_one_process_trainer_learns_and_reports_its_tensors():
    torch.manual_seed(0)
    trainer = build("single", mlp((4, 16, 1), dtype=torch.float64), lr=1e-2)
    x = torch.randn(64, 4, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True)
    losses = [trainer.step(x, y, nn.functional.mse_loss) for _ in range(50)]
    assert losses[-1] < losses[0] / 2
    tensors = trainer.local_tensors()
    assert len(tensors["params"]) == len(tensors["grads"]) == 4
    assert len(tensors["optimizer"]) == 3 * 4  # Adam: step, exp_avg, exp_avg_sq per parameter
    assert set(trainer.full_state()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
