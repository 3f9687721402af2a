"""Pipeline parallelism across processes: one model stage per rank.

Three pieces:

* **stage splitting**: a model as a flat list of named blocks
  (:func:`model_blocks`) cut at configurable split points
  (:func:`split_model`); for ResNet50 the seed's cut is before ``layer3.0``;
* **the library**: ``torch.distributed.pipelining``'s ``PipelineStage`` with
  ``ScheduleGPipe`` or ``Schedule1F1B`` (:func:`library_step`);
* **the same thing by hand**: a GPipe step with point-to-point sends and
  receives (:func:`gpipe_step`), tested against the library.

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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torchvision.models.resnet import ResNet

from .model_parallel import _check_split_size
from .runtime import DistEnv, select_runtime

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
HAND_WRITTEN = "hand-gpipe"
# The seed's cut, as the name of the first block of the second stage.
SEED_SPLIT = "layer3.0"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- splitting

def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as an ordered list of (name, block) that run one after another.

    A torchvision ResNet becomes ``stem``, ``layer1.0`` ... ``layer4.2``, ``head``
    (18 blocks for ResNet50); an ``nn.Sequential`` is its children.
    """
    if isinstance(model, ResNet):
        blocks = [("stem", nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool))]
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
    (the seed's ResNet50 cut) or ``"layer3.1"`` (one more block on stage 0).
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

    @functools.lru_cache(maxsize=None)
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
    return max(1, math.ceil(batch_size / _check_split_size(split_size)))


def scaled_loss(output: torch.Tensor, target: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Cross-entropy summed over the micro-batch and divided by the full batch size."""
    return F.cross_entropy(output, target, reduction="sum") / batch_size


def batch_loss(batch_size: int) -> LossFn:
    """The loss function both pipelines use for a batch of ``batch_size`` samples."""
    return functools.partial(scaled_loss, batch_size=batch_size)


# --------------------------------------------------------------------------- the library

def build_schedule(kind: str, stage_module: nn.Module, n_microbatches: int, loss_fn: LossFn,
                   device: torch.device, group: dist.ProcessGroup | None = None):
    """``PipelineStage`` for this rank plus a GPipe or 1F1B schedule over all ranks."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    stage = PipelineStage(stage_module, rank, world, device, group=group)
    # scale_grads=False: the loss is already divided by the full batch size.
    return SCHEDULES[kind](stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def check_equal_microbatches(batch_size: int, split_size: int) -> None:
    """The library sizes its receive buffers from the first micro-batch, so all must match."""
    if split_size < batch_size and batch_size % split_size:
        raise ValueError(
            f"torch.distributed.pipelining needs equal micro-batches: split_size {split_size} "
            f"does not divide the batch of {batch_size} (the hand-written GPipe accepts it)"
        )


def library_step(schedule, x: torch.Tensor | None, target: torch.Tensor | None,
                 split_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One training step through a library schedule.

    The first stage passes the input, the last stage the target (others pass
    ``None``). Returns (output, loss) on the last stage, (None, None) elsewhere.
    """
    stage = schedule._stage
    x_mbs = [(xs,) for xs in x.split(split_size)] if stage.is_first else None
    t_mbs = list(target.split(split_size)) if stage.is_last else None
    losses: list[torch.Tensor] = []
    output = schedule.step(arg_mbs=x_mbs, target_mbs=t_mbs, losses=losses)
    if not stage.is_last:
        return None, None
    return output, torch.stack(losses).sum()


# --------------------------------------------------------------------------- by hand

_HEADER = 8  # ndim followed by up to 7 sizes


def send_activation(t: torch.Tensor, dst: int) -> list[dist.Work]:
    """Send the shape, then the data; returns the pending sends (keep ``t`` alive)."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = t.dim()
    header[1:1 + t.dim()] = torch.tensor(t.shape)
    header = header.to(t.device)
    # isend, not send: a blocking send would wait for the receiver to be ready
    # and stop this stage from starting the next micro-batch.
    return [dist.isend(header, dst), dist.isend(t.contiguous(), dst)]


def recv_activation(src: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """Receive a header with the shape, then a tensor of that shape."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim = int(header[0])
    buf = torch.empty(header[1:1 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(buf, src)
    return buf


def gpipe_step(stage_module: nn.Module, x: torch.Tensor | None, target: torch.Tensor | None,
               batch_size: int, split_size: int, loss_fn: LossFn,
               device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One GPipe training step written with send/recv: all forwards, then all backwards.

    Every rank holds one stage; ``x`` is needed on the first rank only, ``target``
    on the last. Micro-batches may differ in size (the shape travels first).
    Returns (output, loss) on the last rank, (None, None) elsewhere; gradients
    are accumulated into ``stage_module``'s parameters.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    n = num_microbatches(batch_size, split_size)
    x_mbs = x.split(split_size) if first else [None] * n
    t_mbs = target.split(split_size) if last else [None] * n

    inputs, outputs, pending, results = [], [], [], []
    # Fill: forward every micro-batch, keeping its input and output for backward
    # (GPipe holds m micro-batches of activations per stage).
    for i in range(n):
        if first:
            xi = x_mbs[i]
        else:
            # A received tensor has no autograd history: make it a leaf that
            # collects the gradient to send back upstream.
            xi = recv_activation(rank - 1, device).requires_grad_()
        yi = stage_module(xi)
        if last:
            results.append(yi.detach())
            yi = loss_fn(yi, t_mbs[i])          # the loss is this stage's output
        else:
            pending += send_activation(yi.detach(), rank + 1)
        inputs.append(xi)
        outputs.append(yi)
    # Drain: backward in the same order; each stage needs the gradient of its
    # output from the next stage and returns the gradient of its input.
    for i in range(n):
        if last:
            outputs[i].backward()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, rank + 1)
            outputs[i].backward(grad)
        if not first:
            pending.append(dist.isend(inputs[i].grad.contiguous(), rank - 1))
    for work in pending:
        work.wait()
    if not last:
        return None, None
    return torch.cat(results), torch.stack([o.detach() for o in outputs]).sum()


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


def pipeline_worker(kind: str, x: torch.Tensor, target: torch.Tensor, split_size: int,
                    split_points: Sequence[int | str] = (SEED_SPLIT,), seed: int = 0,
                    num_classes: int = 10, train_mode: bool = False, steps: int = 1) -> dict:
    """Spawned on every rank: one step of ResNet50 through a pipeline of ``kind``.

    ``kind`` is ``gpipe`` or ``1f1b`` (library) or ``hand-gpipe``. Returns this
    rank's gradients under the full model's parameter names, plus output and
    loss on the last rank (all on the CPU), and the order in which this stage
    ran its forwards and backwards. With ``steps > 1`` the same batch runs again
    (gradients zeroed in between) and the last step is reported: the library's
    first step also runs micro-batch 0 once more to learn the shapes.
    """
    env = DistEnv.from_environ()
    # The device follows the process group spawn made: gloo -> CPU, nccl -> this rank's GPU.
    device = select_runtime(env.local_world_size, backend=dist.get_backend()).device(env.local_rank)
    # Exact float32 on GPUs too: TF32 would round convolutions to 10-bit mantissas.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = build_resnet50(seed, num_classes).train(train_mode)
    stages = split_model(model, split_points)
    if len(stages) != env.world_size:
        raise ValueError(f"{len(stages)} stages for {env.world_size} ranks: need one stage per rank")
    stage = stages[env.rank].to(device)
    order = record_order(stage)
    batch = x.shape[0]
    loss_fn = batch_loss(batch)
    x, target = x.to(device), target.to(device)
    if kind != HAND_WRITTEN:
        check_equal_microbatches(batch, split_size)
        schedule = build_schedule(kind, stage, num_microbatches(batch, split_size), loss_fn, device)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        order.clear()
        if kind == HAND_WRITTEN:
            output, loss = gpipe_step(stage, x, target, batch, split_size, loss_fn, device)
        else:
            output, loss = library_step(schedule, x, target, split_size)
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return {
        "rank": env.rank,
        "output": None if output is None else output.detach().cpu(),
        "loss": None if loss is None else loss.detach().cpu(),
        "grads": grads,
        "order": order,
    }
