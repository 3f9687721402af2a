"""Synchronised batch norm on CPU: equal to BatchNorm on the whole batch, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpguide.core.models import ConvNet
from ddpguide.ddp.pitfalls import check_sync_bn
from ddpguide.launch.spawn import spawn
from ddpguide.train.syncbn import (
    CpuSyncBatchNorm,
    comparison_worker,
    convert_sync_batchnorm,
)

TOLERANCE = 1e-5
LIBRARY_CPU_ERROR = "SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone"


def _batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_conversion_is_a_drop_in_replacement_sharing_parameters_and_buffers():
    torch.manual_seed(0)
    model = ConvNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = _batchnorms(model)
    model.eval()
    converted = convert_sync_batchnorm(model, "cpu")
    layers = _batchnorms(converted)
    assert [type(m) for m in layers] == [CpuSyncBatchNorm, CpuSyncBatchNorm]
    for old, new in zip(originals, layers):
        assert new.weight is old.weight and new.bias is old.bias
        assert new.running_mean is old.running_mean and new.running_var is old.running_var
        assert new.num_batches_tracked is old.num_batches_tracked
        assert (new.eps, new.momentum, new.training) == (old.eps, old.momentum, False)
    after = converted.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    ConvNet().load_state_dict(after)  # checkpoints stay interchangeable


@pytest.mark.parametrize("layer", [
    nn.BatchNorm1d(3, affine=False), nn.BatchNorm2d(3, momentum=None),
    nn.BatchNorm3d(3, track_running_stats=False),
])
def test_conversion_keeps_every_option(layer):
    converted = convert_sync_batchnorm(nn.Sequential(layer), "cpu")[0]
    assert isinstance(converted, CpuSyncBatchNorm)
    for option in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
        assert getattr(converted, option) == getattr(layer, option), option
    assert converted.running_mean is layer.running_mean


def test_cuda_conversion_uses_the_library_layer():
    converted = convert_sync_batchnorm(ConvNet(), "cuda")  # a module transformation: no GPU needed
    assert [type(m) for m in _batchnorms(converted)] == [nn.SyncBatchNorm, nn.SyncBatchNorm]


def test_without_a_process_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(4)
    synced = convert_sync_batchnorm(nn.Sequential(reference), "cpu")[0]
    x = torch.randn(6, 4, 3, 3) * 2 + 1
    expected = nn.BatchNorm2d(4)(x)
    assert torch.equal(synced(x), expected)
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        synced(torch.randn(4))


def _assert_all_close(results: list[dict], rounded: float = TOLERANCE) -> None:
    """Every difference within TOLERANCE; output and input gradient within ``rounded``."""
    for case in results:
        assert case, "no comparison ran"
        worst = {name: value for name, value in case.items()
                 if value > (rounded if name in ("output", "input_grad") else TOLERANCE)}
        assert not worst, worst


@pytest.mark.timeout(180)
def test_two_ranks_equal_batchnorm_on_the_concatenated_batch():
    cases = [
        dict(batch_sizes=[3, 5]),                                        # uneven, 2d, affine
        dict(batch_sizes=[4, 4], feature_shape=(3, 7), affine=False),    # 1d over (N, C, L)
        dict(batch_sizes=[1, 6], feature_shape=(3,), momentum=None),     # one sample on a rank
        dict(batch_sizes=[2, 3], track_running_stats=False),
        dict(batch_sizes=[3, 5], dtype=torch.bfloat16),                  # as under autocast
    ]
    results = spawn(comparison_worker, 2, cases, backend="gloo", device_type="cpu", timeout=150)
    assert results[0] == results[1]  # every rank reports the maxima over all ranks
    _assert_all_close(results[0]["cases"][:-1])
    # In bfloat16 the output and the input gradient are rounded to 8 significant bits
    # (an error of at most 2^-8 of the value); the statistics and the weight and bias
    # gradients stay in float32.
    _assert_all_close(results[0]["cases"][-1:], rounded=2 ** -7)
    full = results[0]["cases"][0]
    assert {"output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var",
            "eval_output"} <= set(full)
    # The library's layer cannot do this on CPU: the reason this package has its own.
    assert results[0]["library_error"] == LIBRARY_CPU_ERROR


@pytest.mark.timeout(180)
def test_three_ranks_with_uneven_and_empty_shards():
    cases = [
        dict(batch_sizes=[1, 4, 2], feature_shape=(4, 3, 3)),
        dict(batch_sizes=[0, 5, 3], feature_shape=(3,)),                # rank 0 holds nothing
        dict(batch_sizes=[2, 2, 3], feature_shape=(2, 2, 2, 2), steps=3),  # BatchNorm3d
    ]
    results = spawn(comparison_worker, 3, cases, backend="gloo", device_type="cpu", timeout=150)
    _assert_all_close(results[0]["cases"])


@pytest.mark.timeout(240)
@pytest.mark.multiprocess
def test_ddp_with_sync_bn_trains_like_one_process_on_the_whole_batch():
    # 2 ranks x 32 samples draw, step for step, the same 64 samples as one process
    # with batch 64. With synchronised BN the runs agree up to rounding; with the
    # plain per-rank BN they do not. Measured after 3 steps: 1e-5 to 3e-5 with
    # synchronised BN (rounding, amplified by max-pool ties), 6e-3 with per-rank BN.
    finding = check_sync_bn(world_size=2, batch_size=32, steps=3)
    assert finding.details["ranks_agree"]
    assert finding.details["sync_gap"] <= 5e-4
    assert finding.details["local_gap"] >= 2e-3
    assert finding.shown and "\n" not in str(finding)
