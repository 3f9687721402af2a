"""The central claim of data parallelism, as code the tests check (tests/train/test_loop.py).

N ranks, each on its own slice B/N of a batch, with gradients averaged by DDP,
end with the same parameters as one process on the whole batch B. The reason:
with a mean loss, the gradient over B is the mean of the N slice gradients,
and DDP's all-reduce computes exactly that mean before every optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.core.models import ToyModel

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def make_batches(steps: int, global_batch: int, dtype: torch.dtype, seed: int = 0):
    """Deterministic regression batches for the toy model (inputs 10, targets 5)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(global_batch, 10, generator=generator, dtype=dtype),
         torch.randn(global_batch, 5, generator=generator, dtype=dtype))
        for _ in range(steps)
    ]


def _fresh_model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ToyModel().to(dtype)


def _train(model: nn.Module, batches, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.MSELoss()
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def single_process_parameters(steps: int = 5, global_batch: int = 16, dtype: str = "float64",
                              lr: float = 0.1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` SGD steps of one process on the whole batch."""
    torch_dtype = DTYPES[dtype]
    model = _fresh_model(torch_dtype, seed)
    _train(model, make_batches(steps, global_batch, torch_dtype, seed), lr)
    return _parameters(model)


def ddp_parameters_worker(steps: int = 5, global_batch: int = 16, dtype: str = "float64",
                          lr: float = 0.1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Runs on every rank: DDP on this rank's slice of each batch; returns the parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
    torch_dtype = DTYPES[dtype]
    model = DDP(_fresh_model(torch_dtype, seed))
    per_rank = global_batch // world_size
    mine = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
            for x, y in make_batches(steps, global_batch, torch_dtype, seed)]
    _train(model, mine, lr)
    return _parameters(model)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise difference between two parameter sets with the same names."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)
