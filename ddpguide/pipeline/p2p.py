"""Point-to-point pipelining by hand: activations sent with their shape, and a
GPipe step (all forwards, then all backwards) written with ``isend``/``irecv``.

The tests check :func:`gpipe_step` against the library's ``ScheduleGPipe``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpguide.pipeline.stages import LossFn, num_microbatches

_HEADER = 8  # ndim followed by up to 7 sizes


def send_activation(t: torch.Tensor, dst: int) -> list[dist.Work]:
    """Send the shape, then the data; returns the pending sends (keep ``t`` alive)."""
    if t.dim() > _HEADER - 1:  # fail here, not in a receiver waiting for a header
        raise ValueError(f"send_activation sends at most {_HEADER - 1} dimensions, got a "
                         f"tensor of {t.dim()}")
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
