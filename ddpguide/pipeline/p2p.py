"""The hand-written pipeline's transfers: an activation (or its gradient) sent with its shape.

Built on :func:`ddpguide.collectives.p2p.send_recv`, which knows how gloo and
nccl must be asked. The schedule that uses them, the hand-written GPipe, is
:func:`ddpguide.pipeline.schedules.gpipe_step`, next to the library's schedules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpguide.collectives.p2p import send_recv, wait

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
    # Not waited for here: a blocking send would wait for the receiver to be ready
    # and stop this stage from starting the next micro-batch.
    return send_recv(header, dst, None, 0) + send_recv(t.contiguous(), dst, None, 0)


def recv_activation(src: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """Receive a header with the shape, then a tensor of that shape."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    wait(send_recv(None, 0, header, src))
    ndim = int(header[0])
    return recv_tensor(torch.empty(header[1:1 + ndim].tolist(), dtype=dtype, device=device), src)


def send_tensor(t: torch.Tensor, dst: int) -> list[dist.Work]:
    """Send ``t`` (whose shape the receiver knows); returns the pending sends (keep ``t`` alive)."""
    return send_recv(t, dst, None, 0)


def recv_tensor(buf: torch.Tensor, src: int) -> torch.Tensor:
    """Receive into ``buf`` (of the sent shape) from ``src``, and return it."""
    wait(send_recv(None, 0, buf, src))
    return buf
