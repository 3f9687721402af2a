"""Synchronised batch norm: batch statistics over the global batch, on any device.

With DDP each rank normalises its own slice of the batch. Batch norm then sees
a batch N times smaller than the one the optimiser effectively uses, and its
statistics differ from rank to rank. ``nn.SyncBatchNorm`` fixes this on GPUs,
but refuses CPU tensors (``SyncBatchNorm expected input tensor to be on GPU``),
so the package carries its own version for CPU ranks:

* forward: each rank packs ``[count, sum, sum of squares]`` per channel into one
  float64 tensor, one ``all_reduce`` adds them up, and every rank normalises
  with the global mean and biased variance. The per-rank sums are built from
  the rank's own mean and centred variance, and carried in float64, so the
  global ``E[x^2] - E[x]^2`` does not cancel catastrophically;
* backward: the input gradient needs two global per-channel sums, ``sum(dy)``
  and ``sum(dy * xhat)``; one more ``all_reduce`` provides them. The weight and
  bias gradients stay local: DDP averages them like any other gradient;
* running statistics: updated with the global mean and the global *unbiased*
  variance, with ``momentum`` (or the cumulative average when it is None),
  exactly as ``BatchNorm`` does on the full batch;
* evaluation mode, or no process group, or one rank: plain ``F.batch_norm``.

Ranks may hold different numbers of samples, even none: the packed counts
weigh each rank's contribution.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channel dimension 1."""
    return [0, *range(2, x.dim())]


def _channel_view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a per-channel vector (C,) to broadcast against x (N, C, ...)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm over the union of all ranks' batches, with its exact gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        channels = x.size(1)
        dims = _reduce_dims(x)
        local_count = x.numel() // channels if channels else 0
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float()  # statistics in float32 even when autocast feeds bf16/fp16
            if local_count > 0:
                var, mean = torch.var_mean(xf, dim=dims, correction=0)
            else:  # an empty shard still joins the collective, contributing nothing
                var = mean = xf.new_zeros(channels)
            mean64, var64 = mean.double(), var.double()
            packed = torch.cat([
                mean64.new_full((1,), float(local_count)),
                mean64 * local_count,                         # sum of x
                (var64 + mean64 * mean64) * local_count,      # sum of x^2
            ])
            dist.all_reduce(packed, group=group)
            count = packed[0].item()
            if count <= 1:
                raise ValueError("Expected more than 1 value per channel when training, "
                                 f"got input size {int(count)} over all ranks")
            global_mean = packed[1:1 + channels] / count
            global_var = (packed[1 + channels:] / count - global_mean * global_mean).clamp_(min=0)
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                     alpha=momentum)
            if running_var is not None:
                unbiased = global_var * (count / (count - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
            mean32 = global_mean.float()
            invstd = torch.rsqrt(global_var + eps).float()
            out = (xf - _channel_view(mean32, x)) * _channel_view(invstd, x)
            if weight is not None:
                out = out * _channel_view(weight.float(), x)
            if bias is not None:
                out = out + _channel_view(bias.float(), x)
        ctx.save_for_backward(x, weight, mean32, invstd)
        ctx.count = count
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduce_dims(x)
        dy = grad_out.float()
        xhat = (x.float() - _channel_view(mean, x)) * _channel_view(invstd, x)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # The mean and variance depend on every rank's inputs, so the input
            # gradient needs the two sums over the global batch.
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, group=ctx.group)
            global_dy, global_dy_xhat = packed.split(sum_dy.numel())
            scale = invstd if weight is None else invstd * weight.float()
            grad_x = (dy - _channel_view(global_dy / ctx.count, x)
                      - xhat * _channel_view(global_dy_xhat / ctx.count, x))
            grad_x = (grad_x * _channel_view(scale, x)).to(x.dtype)
        # Weight and bias gradients are local sums; DDP's gradient all-reduce
        # combines them like every other parameter's.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class CpuSyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics span all ranks of ``process_group``.

    A drop-in replacement for ``BatchNorm1d/2d/3d`` (same parameters, buffers
    and state-dict keys) that works with gloo on CPU, and with any backend
    that can ``all_reduce`` the input's device. Build it with
    :func:`convert_sync_batchnorm`.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # Momentum and counters exactly as in _BatchNorm.forward.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            tracked = self.num_batches_tracked
            assert tracked is not None  # registered when track_running_stats is set
            tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        group = self.process_group or (dist.group.WORLD if dist.is_initialized() else None)
        sync = (self.training and batch_stats and group is not None
                and dist.get_world_size(group) > 1)
        if not sync:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                batch_stats, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, group)


def convert_sync_batchnorm(module: nn.Module, device_type: str,
                           process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every batch-norm layer of ``module`` by a synchronised one.

    On ``cuda`` this is ``nn.SyncBatchNorm.convert_sync_batchnorm``; on ``cpu``
    the layers become :class:`CpuSyncBatchNorm`, which share the original
    parameters and buffers (a checkpoint of either loads into the other).
    Convert before wrapping the model in DDP.
    """
    if device_type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert_cpu(module, process_group)


def _convert_cpu(module: nn.Module, process_group) -> nn.Module:
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        converted = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum,
                                     module.affine, module.track_running_stats, process_group)
        # Share (not copy) parameters and buffers, as nn.SyncBatchNorm's conversion does.
        converted.weight = module.weight
        converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
    for name, child in module.named_children():
        converted.add_module(name, _convert_cpu(child, process_group))
    return converted


# ---------------------------------------------------------------------------
# Checks against the library: run on every rank of a process group.

_BN_BY_INPUT_DIMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def compare_with_batchnorm(batch_sizes: Sequence[int], feature_shape: Sequence[int] = (4, 5, 5),
                           steps: int = 2, affine: bool = True, track_running_stats: bool = True,
                           momentum: float | None = 0.1, seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Largest differences between synchronised BN on shards and ``nn.BatchNorm`` on the whole batch.

    Every rank of the default group calls this; rank ``r`` holds
    ``batch_sizes[r]`` samples of one batch (uneven sizes and empty shards
    allowed). For ``steps`` training steps it compares the output, the input
    gradient, the weight and bias gradients (summed over ranks, as DDP's
    all-reduce would), the running statistics, and finally the evaluation-mode
    output. With ``dtype=torch.bfloat16`` the shards arrive in bfloat16, as
    under autocast, and the reference sees the same rounded values in float32.
    Returns, for each, the largest difference over all ranks, as a
    fraction of the reference's largest magnitude (or absolute, below 1).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(batch_sizes) != world:
        raise ValueError(f"batch_sizes has {len(batch_sizes)} entries for {world} ranks")
    channels = feature_shape[0]
    reference = _BN_BY_INPUT_DIMS[1 + len(feature_shape)](channels, momentum=momentum, affine=affine,
                                                   track_running_stats=track_running_stats)
    gen = torch.Generator().manual_seed(seed)
    if affine:
        with torch.no_grad():
            reference.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
            reference.bias.copy_(torch.randn(channels, generator=gen))
    synced = convert_sync_batchnorm(copy.deepcopy(reference), "cpu")
    start = sum(batch_sizes[:rank])
    mine = slice(start, start + batch_sizes[rank])
    diffs: dict[str, float] = {}

    def note(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
        # Relative to the reference's scale (at least 1): gradients summed over
        # many elements are large, and their float32 rounding grows with them.
        value = 0.0
        if ref.numel():
            value = ((ours - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
        diffs[name] = max(diffs.get(name, 0.0), value)

    for _ in range(steps):
        # Inputs far from zero mean: a naive E[x^2] - E[x]^2 would show here.
        x = (torch.randn(sum(batch_sizes), *feature_shape, generator=gen) * 3 + 5).to(dtype)
        upstream = torch.randn(x.shape, generator=gen).to(dtype).float()
        x_full = x.float().clone().requires_grad_()
        x_mine = x[mine].clone().requires_grad_()
        y_full = reference(x_full)
        (y_full * upstream).sum().backward()
        y_mine = synced(x_mine)
        if y_mine.dtype != dtype:
            raise TypeError(f"output dtype {y_mine.dtype} differs from input dtype {dtype}")
        (y_mine.float() * upstream[mine]).sum().backward()
        note("output", y_mine.float(), y_full[mine])
        assert x_mine.grad is not None and x_full.grad is not None  # both had a backward
        note("input_grad", x_mine.grad.float(), x_full.grad[mine])
        if affine:
            for name in ("weight", "bias"):
                grad = getattr(synced, name).grad.clone()
                dist.all_reduce(grad)
                note(f"{name}_grad", grad, getattr(reference, name).grad)
                getattr(synced, name).grad = getattr(reference, name).grad = None
        if track_running_stats:
            for name in ("running_mean", "running_var"):
                note(name, synced.get_buffer(name), reference.get_buffer(name))
            note("batches_tracked", synced.get_buffer("num_batches_tracked").float(),
                 reference.get_buffer("num_batches_tracked").float())
    synced.eval()
    reference.eval()
    probe = torch.randn(3, *feature_shape, generator=gen)
    with torch.no_grad():
        note("eval_output", synced(probe), reference(probe))
    values = torch.tensor(list(diffs.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, values.tolist()))


def library_error_on_cpu() -> str:
    """What ``nn.SyncBatchNorm`` says when it is trained on CPU tensors (call on every rank)."""
    layer = nn.SyncBatchNorm(2)
    try:
        layer(torch.randn(4, 2, 3))
    except ValueError as exc:
        return str(exc)
    return ""


def comparison_worker(cases: Sequence[dict]) -> dict:
    """Spawned on every rank: :func:`compare_with_batchnorm` for each case, and the library's error.

    The comparison uses CPU tensors: launch it with ``backend="gloo", device_type="cpu"``.
    """
    return {"cases": [compare_with_batchnorm(**case) for case in cases],
            "library_error": library_error_on_cpu()}
