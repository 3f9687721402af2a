"""Pipeline parallelism across processes: one model stage per rank.

This module cuts a model into stages and a batch into micro-batches:

* **stage splitting**: a model as a flat list of named blocks
  (:func:`model_blocks`) cut at configurable split points
  (:func:`split_model`); for ResNet50 the source's cut is before ``layer3.0``;
* **micro-batches** and the loss they share (:func:`batch_loss`).

The library's schedules are in :mod:`ddpguide.pipeline.schedules`, the same
thing by hand in :mod:`ddpguide.pipeline.p2p`.

Loss convention (both paths): ``loss_fn`` returns the *sum* of per-sample
losses divided by the full batch size, and gradients are not rescaled, so the
micro-batch gradients add up to the full batch's gradient even when the last
micro-batch is smaller.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import ResNet

# The source's cut, as the name of the first block of the second stage.
SEED_SPLIT = "layer3.0"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- splitting

def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as an ordered list of (name, block) that run one after another.

    A torchvision ResNet becomes ``stem``, ``layer1.0`` ... ``layer4.2``, ``head``
    (18 blocks for ResNet50); an ``nn.Sequential`` is its children.
    """
    if isinstance(model, ResNet):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        blocks: list[tuple[str, nn.Module]] = [("stem", stem)]
        for layer in ("layer1", "layer2", "layer3", "layer4"):
            blocks += [(f"{layer}.{i}", b) for i, b in enumerate(getattr(model, layer))]
        blocks.append(("head", nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)))
        return blocks
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise TypeError(f"cannot split a {type(model).__name__}: pass a ResNet or an nn.Sequential")


def split_index(blocks: Sequence[tuple[str, nn.Module]], point: int | str) -> int:
    """Where a stage starts: a block index, or the name of the stage's first block."""
    names = [name for name, _ in blocks]
    if isinstance(point, str):
        if point not in names:
            raise ValueError(f"no block named {point!r}; blocks are {', '.join(names)}")
        point = names.index(point)
    if not 0 < point < len(blocks):
        raise ValueError(f"split point {point} must be between 1 and {len(blocks) - 1}")
    return point


def split_model(model: nn.Module, split_points: Sequence[int | str] = (SEED_SPLIT,)) -> list[nn.Sequential]:
    """Cut ``model`` into ``len(split_points) + 1`` stages (the blocks are shared, not copied).

    Each split point names the first block of the next stage, e.g. ``"layer3.0"``
    (the source's ResNet50 cut) or ``"layer3.1"`` (one more block on stage 0).
    """
    blocks = model_blocks(model)
    cuts = [split_index(blocks, p) for p in split_points]
    if cuts != sorted(set(cuts)):
        raise ValueError(f"split points must be increasing and distinct, got {list(split_points)}")
    bounds = [0, *cuts, len(blocks)]
    return [
        # Module names cannot contain dots: layer3.0 -> layer3_0.
        nn.Sequential(OrderedDict((n.replace(".", "_"), b) for n, b in blocks[lo:hi]))
        for lo, hi in zip(bounds, bounds[1:])
    ]


def balanced_split(block_times: Sequence[float], num_stages: int = 2) -> list[int]:
    """Split indices that minimise the slowest stage, given each block's time.

    The pipeline's steady state runs at the pace of its slowest stage, so this
    is the split to use once the blocks have been timed (exhaustive for 2-3
    stages, which is all a small machine runs).
    """
    n = len(block_times)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {num_stages} stages")
    prefix = [0.0]
    for t in block_times:
        prefix.append(prefix[-1] + t)

    @functools.cache
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        if stages == 1:
            return prefix[n] - prefix[start], ()
        options = []
        for cut in range(start + 1, n - stages + 2):
            rest, cuts = best(cut, stages - 1)
            options.append((max(prefix[cut] - prefix[start], rest), (cut, *cuts)))
        return min(options)

    return list(best(0, num_stages)[1])


# --------------------------------------------------------------------------- micro-batches

def num_microbatches(batch_size: int, split_size: int) -> int:
    """How many micro-batches ``x.split(split_size)`` makes of a batch."""
    return max(1, math.ceil(batch_size / check_split_size(split_size)))


def scaled_loss(output: torch.Tensor, target: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch and divided by the full batch size."""
    return F.cross_entropy(output, target, reduction="sum") / batch_size


def batch_loss(batch_size: int) -> LossFn:
    """The loss function both pipelines use for a batch of ``batch_size`` samples."""
    return functools.partial(scaled_loss, batch_size=batch_size)


# --------------------------------------------------------------------------- the library


# --------------------------------------------------------------------------- by hand


# --------------------------------------------------------------------------- the worker

def build_resnet50(seed: int = 0, num_classes: int = 10) -> ResNet:
    """ResNet50 with random weights from ``seed`` (the same on every rank)."""
    from torchvision.models import resnet50

    torch.manual_seed(seed)
    return resnet50(num_classes=num_classes)


def record_order(module: nn.Module) -> list[str]:
    """Log ``F<i>`` when ``module`` runs its i-th forward and ``B<i>`` when the
    gradient of that output arrives: the order a schedule really executes."""
    order: list[str] = []

    def on_forward(_module, _inputs, output):
        i = sum(op[0] == "F" for op in order)
        order.append(f"F{i}")
        output.register_hook(lambda grad: order.append(f"B{i}"))

    module.register_forward_hook(on_forward)
    return order


def check_split_size(split_size: object) -> int:
    """``split_size`` itself, or ValueError unless it is a positive integer."""
    if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size <= 0:
        raise ValueError(f"split_size must be a positive integer, got {split_size!r}")
    return split_size
