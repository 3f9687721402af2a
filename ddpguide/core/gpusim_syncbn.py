"""SyncBatchNorm on the simulated GPU machine (:mod:`ddpguide.core.gpusim`).

torch's ``SyncBatchNorm`` runs on GPUs only: DDP refuses it in a module on the host, its
``forward`` refuses an input on the host, and five of the kernels it calls
(``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) exist for CUDA only. Here a
module or input tagged with a simulated GPU passes both checks, and the five kernels are
registered for the CPU with the arithmetic of CUDA's (the statistics of every rank's batch
merged by their counts), so torch's own ``SyncBatchNorm`` and its all-gather run unchanged."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ddpguide.core import gpusim_state as sim

_LIBRARY: list[Any] = []  # the registration lives as long as the process


def _channels(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()  # CUDA's accumulation type


def stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = _acc(input)
    var, mean = torch.var_mean(x, dim=_channels(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def gather_stats_with_counts(input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                             running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                             momentum: float, eps: float, counts: torch.Tensor,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    n = counts.to(mean.dtype).reshape(-1, 1)
    total = n.sum()
    global_mean = (n * mean).sum(0) / total
    var_each = 1.0 / (invstd * invstd) - eps
    var = (n * (var_each + (mean - global_mean) ** 2)).sum(0) / total  # biased
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * total / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return global_mean, torch.rsqrt(var + eps)


def elemt(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
          mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    out = (_acc(input) - _per_channel(mean, input)) * _per_channel(invstd, input)
    if weight is not None:
        out = out * _per_channel(weight, input)
    if bias is not None:
        out = out + _per_channel(bias, input)
    return out.to(input.dtype)


def backward_reduce(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor,
                    invstd: torch.Tensor, weight: torch.Tensor | None, input_g: bool,
                    weight_g: bool, bias_g: bool) -> tuple[torch.Tensor, ...]:
    dy, x = _acc(grad_out), _acc(input)
    sum_dy = dy.sum(_channels(x))
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(_channels(x))
    grad_weight = sum_dy_xmu * invstd
    dtype = weight.dtype if weight is not None else input.dtype
    return sum_dy, sum_dy_xmu, grad_weight.to(dtype), sum_dy.to(dtype)


def backward_elemt(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor,
                   invstd: torch.Tensor, weight: torch.Tensor | None, sum_dy: torch.Tensor,
                   sum_dy_xmu: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    dy, x = _acc(grad_out), _acc(input)
    total = count.sum().to(sum_dy.dtype)
    scale = invstd if weight is None else invstd * _acc(weight)
    grad = (dy - _per_channel(sum_dy / total, x)
            - (x - _per_channel(mean, x)) * _per_channel(invstd * invstd * sum_dy_xmu / total, x))
    return (grad * _per_channel(scale, x)).to(input.dtype)


KERNELS = {"batch_norm_stats": stats, "batch_norm_gather_stats_with_counts": gather_stats_with_counts,
           "batch_norm_elemt": elemt, "batch_norm_backward_reduce": backward_reduce,
           "batch_norm_backward_elemt": backward_elemt}


def _on_a_gpu(tensors: Any) -> bool:
    tags = [getattr(t, sim.TAG, sim.HOST) for t in tensors]
    return bool(tags) and min(tags) >= 0


def install() -> None:
    """Register the five kernels for the CPU; let DDP and ``forward`` take a simulated GPU's."""
    from torch.nn.modules.batchnorm import SyncBatchNorm
    from torch.nn.parallel import DistributedDataParallel as DDP

    library = torch.library.Library("aten", "IMPL")
    for name, kernel in KERNELS.items():
        library.impl(name, kernel, "CPU")
    _LIBRARY.append(library)

    original_handle: Any = DDP._passing_sync_batchnorm_handle

    @functools.wraps(original_handle)
    def handle(self: Any, module: Any) -> None:
        if not _on_a_gpu(module.parameters()):  # DDP's device_type is "cpu" for a tagged module
            original_handle(self, module)

    DDP._passing_sync_batchnorm_handle = handle  # type: ignore[method-assign]
    original_forward = SyncBatchNorm.forward

    @functools.wraps(original_forward)
    def forward(self: Any, input: torch.Tensor) -> torch.Tensor:
        state = sim.STATE
        if state is None or not _on_a_gpu([input]):
            return original_forward(self, input)
        state.told_cuda.add(id(input))  # forward's device check reads cuda:K, as on a GPU
        try:
            return original_forward(self, input)
        finally:
            state.told_cuda.discard(id(input))

    SyncBatchNorm.forward = forward  # type: ignore[method-assign]
