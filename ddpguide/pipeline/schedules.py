"""Pipeline schedules from ``torch.distributed.pipelining``, and the chapter's worker.

:func:`build_schedule` makes this rank's ``PipelineStage`` and a GPipe or 1F1B
schedule over all ranks, after checking that the batch splits into equal
micro-batches (the library sizes its receive buffers from the first one).
:func:`pipeline_worker` runs one step through the library or through the
hand-written GPipe (:func:`gpipe_step`, all forwards then all backwards, its
messages sent with :mod:`ddpguide.pipeline.p2p`), for the tests and chapter.
The tests check :func:`gpipe_step` against the library's ``ScheduleGPipe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from ddpguide.core.runtime import worker_device
from ddpguide.pipeline.p2p import recv_activation, recv_tensor, send_activation, send_tensor
from ddpguide.pipeline.stages import (
    SEED_SPLIT,
    LossFn,
    batch_loss,
    build_resnet50,
    num_microbatches,
    record_order,
    split_model,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


HAND_WRITTEN = "hand-gpipe"


@dataclass
class LibrarySchedule:
    """A library schedule with what a step needs to know about this rank's stage."""

    schedule: PipelineScheduleSingle
    is_first: bool
    is_last: bool
    split_size: int


def build_schedule(kind: str, stage_module: nn.Module, batch_size: int, split_size: int,
                   loss_fn: LossFn, device: torch.device,
                   group: dist.ProcessGroup | None = None) -> LibrarySchedule:
    """``PipelineStage`` for this rank plus a GPipe or 1F1B schedule over all ranks.

    Checks the schedule kind and the micro-batch sizes before any stage talks
    to another, so a bad ``split_size`` fails on every rank at once instead of
    a shape error on the last stage while the others wait.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    check_equal_microbatches(batch_size, split_size)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    stage = PipelineStage(stage_module, rank, world, device, group=group)
    # scale_grads=False: the loss is already divided by the full batch size.
    schedule = SCHEDULES[kind](stage, num_microbatches(batch_size, split_size),
                               loss_fn=loss_fn, scale_grads=False)
    return LibrarySchedule(schedule, stage.is_first, stage.is_last, split_size)


def check_equal_microbatches(batch_size: int, split_size: int) -> None:
    """The library sizes its receive buffers from the first micro-batch, so all must match."""
    if split_size < batch_size and batch_size % split_size:
        raise ValueError(
            f"torch.distributed.pipelining needs equal micro-batches: split_size {split_size} "
            f"does not divide the batch of {batch_size} (the hand-written GPipe accepts it)"
        )


def _split(t: torch.Tensor | None, split_size: int, what: str) -> tuple[torch.Tensor, ...]:
    """``t`` cut into micro-batches, on the stage that must be given it."""
    if t is None:
        raise ValueError(f"this stage needs the {what}, got None")
    return t.split(split_size)


def library_step(pipe: LibrarySchedule, x: torch.Tensor | None,
                 target: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One training step through a library schedule.

    The first stage passes the input, the last stage the target (others pass
    ``None``). Returns (output, loss) on the last stage, (None, None) elsewhere.
    """
    x_mbs = [(xs,) for xs in _split(x, pipe.split_size, "input")] if pipe.is_first else None
    t_mbs = list(_split(target, pipe.split_size, "target")) if pipe.is_last else None
    losses: list[torch.Tensor] = []
    output = pipe.schedule.step(arg_mbs=x_mbs, target_mbs=t_mbs, losses=losses)
    if not pipe.is_last:
        return None, None
    return output, torch.stack(losses).sum()


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
    x_mbs = _split(x, split_size, "input") if first else ()  # read on the first rank only
    t_mbs = _split(target, split_size, "target") if last else ()  # and on the last

    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    pending: list[dist.Work] = []
    results: list[torch.Tensor] = []
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
            outputs[i].backward(recv_tensor(torch.empty_like(outputs[i]), rank + 1))
        if not first:
            grad = inputs[i].grad
            assert grad is not None  # a received input is a leaf that requires grad
            pending += send_tensor(grad.contiguous(), rank - 1)
    for work in pending:
        work.wait()
    if not last:
        return None, None
    return torch.cat(results), torch.stack([o.detach() for o in outputs]).sum()


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
    rank, world = dist.get_rank(), dist.get_world_size()
    device = worker_device()
    # Exact float32 on GPUs too: TF32 would round convolutions to 10-bit mantissas.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = build_resnet50(seed, num_classes).train(train_mode)
    stages = split_model(model, split_points)
    if len(stages) != world:
        raise ValueError(f"{len(stages)} stages for {world} ranks: need one stage per rank")
    stage = stages[rank].to(device)
    order = record_order(stage)
    batch = x.shape[0]
    loss_fn = batch_loss(batch)
    x, target = x.to(device), target.to(device)
    if kind != HAND_WRITTEN:
        pipe = build_schedule(kind, stage, batch, split_size, loss_fn, device)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        order.clear()
        if kind == HAND_WRITTEN:
            output, loss = gpipe_step(stage, x, target, batch, split_size, loss_fn, device)
        else:
            output, loss = library_step(pipe, x, target)
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return {
        "rank": rank,
        "output": None if output is None else output.detach().cpu(),
        "loss": None if loss is None else loss.detach().cpu(),
        "grads": grads,
        "order": order,
    }
