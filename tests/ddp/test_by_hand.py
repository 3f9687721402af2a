"""DDP by hand: the hand-written ring, buckets and a parameter server vs PyTorch's DDP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpguide.core.models import ToyModel
from ddpguide.ddp import by_hand as ddp_by_hand

TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def _calls(world: int) -> dict[str, tuple]:
    calls = {f"ddp_{dtype}": (ddp_by_hand.compare_with_ddp, 3, dtype) for dtype in TOLERANCE}
    calls.update({f"ps_{dtype}": (ddp_by_hand.parameter_server, 3, dtype) for dtype in TOLERANCE})
    calls["ddp_auto"] = (ddp_by_hand.compare_with_ddp, 2, torch.float32, 0.1, "auto")
    calls["buckets"] = (ddp_by_hand.bucketing_savings, 3, 4, 1, "recursive_doubling")
    return calls


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_ring_averaging_gives_ddp_and_single_process_parameters(spawned, world, dtype):
    per_rank = [r[f"ddp_{dtype}"] for r in spawned(world)]
    torch.manual_seed(0)  # the start: the same seed as the workers
    initial = dict(ToyModel().to(dtype).named_parameters())
    for result in per_rank:
        assert result["by_hand"]["net1.weight"].dtype == dtype
        assert _max_diff(result["by_hand"], result["ddp"]) <= TOLERANCE[dtype]
        assert _max_diff(result["by_hand"], result["single"]) <= TOLERANCE[dtype]
        assert _max_diff(result["bucketed"], result["ddp"]) <= TOLERANCE[dtype]
        # the parameters moved: training really happened
        assert _max_diff(result["by_hand"], {n: p.detach() for n, p in initial.items()}) > 1e-3
    for result in per_rank[1:]:  # the replicas stay bit-identical
        for name, value in result["by_hand"].items():
            assert torch.equal(value, per_rank[0]["by_hand"][name])


@pytest.mark.timeout(240)
def test_auto_algorithm_also_matches_ddp(spawned):
    for result in spawned(4):
        assert _max_diff(result["ddp_auto"]["by_hand"], result["ddp_auto"]["ddp"]) <= 1e-6


@pytest.mark.timeout(240)
def test_buckets_start_during_backward_from_the_last_layer(spawned):
    launches = spawned(4)[0][f"ddp_{torch.float32}"]["bucket_launches"]
    # bucket_cap 256 bytes: net2 (200 + 20 bytes) and net1.bias share one, net1.weight is alone
    assert launches == [(0, ["net2.bias", "net2.weight", "net1.bias"], 1),
                        (1, ["net1.weight"], 0)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_parameter_server_equals_sgd_on_one_process(spawned, world, dtype):
    per_rank = [r[f"ps_{dtype}"] for r in spawned(world)]
    for result in per_rank:
        assert result["parameters"].dtype == dtype
        assert (result["parameters"] - result["single"]).abs().max().item() <= TOLERANCE[dtype]
        assert torch.equal(result["parameters"], per_rank[0]["parameters"])


@pytest.mark.timeout(240)
def test_bucketing_measurement_reports_both_cases(spawned):
    result = spawned(4)[0]["buckets"]
    assert result["parameters"] == 6 and result["bytes"] == 3 * (4 * 4 + 4) * 4
    assert result["per_parameter_s"] > 0 and result["one_bucket_s"] > 0
    assert result["ratio"] == result["per_parameter_s"] / result["one_bucket_s"]


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_parameter_without_gradient_is_reported(one_rank_group):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    sync = ddp_by_hand.BucketedGradientSync(model, bucket_cap_bytes=1)
    model[1](torch.ones(2, 3)).sum().backward()  # model[0] gets no gradient
    with pytest.raises(RuntimeError, match=r"^buckets \[2, 3\] never became ready: a parameter got "
                                           r"no gradient \(DDP's find_unused_parameters=True"):
        sync.finish()


def test_average_gradients_on_one_rank_keeps_the_gradient(one_rank_group):
    model = nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    ddp_by_hand.average_gradients(model)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_parameter_server_needs_two_ranks(one_rank_group):
    with pytest.raises(ValueError, match=r"^a parameter server needs at least 2 ranks"):
        ddp_by_hand.parameter_server()
