"""The hand-written ZeRO-3 (``ddpguide.sharding.zero3``) on models beyond the book's MLP.

Each model trains two SGD steps sharded and plain from the same weights, in float64,
on a one-rank gloo group (the hooks free and refill the parameters' storage at any
world size, which is where these models used to fail); the weights must agree.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_dist_composable import CompositeParamModel

from ddpguide.sharding.zero3 import ShardedModel, ShardingError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


class OwnsAndReturnsTuple(nn.Module):
    """A module that owns its weight and returns two tensors (as nn.LSTM and nn.GRU do)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x):
        y = x @ self.weight
        return y, y.tanh()


class TupleThenLinear(nn.Module):
    def __init__(self, use_both: bool):
        super().__init__()
        # `front` makes the tuple module's input need a gradient: its backward reads its weight.
        self.front = nn.Linear(4, 4, dtype=torch.float64)
        self.first = OwnsAndReturnsTuple()
        self.last = nn.Linear(4, 2, dtype=torch.float64)
        self.use_both = use_both

    def forward(self, x):
        y, aux = self.first(self.front(x))
        return self.last(y + aux if self.use_both else y)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, dtype=torch.float64)

    def forward(self, x):
        return self.attention(x, x, x)[0]


def train_both(model: nn.Module, inputs: torch.Tensor, steps: int = 2) -> float:
    """Largest weight difference, sharded vs plain, after ``steps`` SGD steps."""
    plain = copy.deepcopy(model)
    sharded = ShardedModel(model)
    optimizers = (torch.optim.SGD(sharded.parameters(), lr=0.1),
                  torch.optim.SGD(plain.parameters(), lr=0.1))
    for _ in range(steps):
        for net, optimizer in zip((model, plain), optimizers):
            optimizer.zero_grad()
            net(inputs).pow(2).sum().backward()
            optimizer.step()
    full = sharded.full_state()
    return max((full[name] - p).abs().max().item() for name, p in plain.named_parameters())


@pytest.mark.parametrize("use_both", [True, False], ids=["both-outputs-used", "one-output-used"])
def test_a_module_that_owns_parameters_and_returns_a_tuple_trains(one_rank, use_both):
    torch.manual_seed(0)
    assert train_both(TupleThenLinear(use_both), torch.randn(3, 4, dtype=torch.float64)) <= 1e-12


def test_multihead_attention_reading_its_child_weight_trains(one_rank):
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj.
    torch.manual_seed(0)
    assert train_both(Attention(), torch.randn(5, 3, 8, dtype=torch.float64)) <= 1e-12


def test_pytorch_composite_test_model_trains(one_rank):
    # PyTorch's own test model for composable FSDP: the root owns `p` beside its children.
    torch.manual_seed(0)
    model = CompositeParamModel(torch.device("cpu")).double()
    assert train_both(model, torch.randn(4, 100, dtype=torch.float64)) <= 1e-12


def test_no_grad_forward_runs_and_gradients_accumulate(one_rank):
    torch.manual_seed(0)
    model = TupleThenLinear(use_both=True)
    plain = copy.deepcopy(model)
    sharded = ShardedModel(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(model(x), plain(x), rtol=0, atol=1e-12)
    for half in (x[:2], x[2:]):  # two micro-batches, one step
        model(half).sum().backward()
        plain(half).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    got = torch.cat([s.shard.grad[: s.numel] for s in sharded.shards])
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_tied_weights_are_refused_in_one_line(one_rank):
    embedding, output = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    output.weight = embedding.weight
    with pytest.raises(ShardingError, match=r"^parameter '1\.weight' is the same tensor as "
                                            r"'0\.weight': shared parameters cannot be sharded "
                                            r"module by module$"):
        ShardedModel(nn.Sequential(embedding, output))
