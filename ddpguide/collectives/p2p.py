"""Point-to-point messages that work on gloo and nccl alike: the one place that knows the rule.

:func:`send_recv` posts a receive from one rank and a send to another (either
may be None) and returns the pending requests; :func:`wait` waits for them.
Every hand-written exchange of the package goes through it: the rings and
recursive doubling of :mod:`ddpguide.collectives.algorithms`, the activations
of the hand-written pipeline (:mod:`ddpguide.pipeline.p2p`), and a ring of
attention blocks passing keys and values.

The rule: with nccl the two are grouped (``batch_isend_irecv``), because a
lone send to a peer that is itself sending would wait forever; gloo needs no
grouping (its sends and receives are asynchronous) and posting them one by
one costs less, but the receive is posted first: a gloo send leaves only once
the peer says it is ready to receive. Empty messages are skipped on both
sides: gloo never completes a 0-byte send. Only the order of messages between
two ranks matters, never tags, which nccl ignores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def send_recv(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
              group=None) -> list:
    """Post a receive into ``recv`` from ``src`` and a send of ``send`` to ``dst``; return the requests.

    Ranks are ranks of ``group`` (the default group when None). The receive
    comes first in the list. Keep ``send`` alive until :func:`wait` returns.
    """
    recv = recv if recv is not None and recv.numel() else None
    send = send if send is not None and send.numel() else None
    if dist.get_backend(group) == "nccl":
        ops = [dist.P2POp(dist.irecv, recv, group=group, group_peer=src)] if recv is not None else []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=dst))
        return dist.batch_isend_irecv(ops) if ops else []
    # Receive first: a gloo send leaves only once the peer says it is ready to receive.
    requests = [dist.irecv(recv, group=group, group_src=src)] if recv is not None else []
    if send is not None:
        requests.append(dist.isend(send, group=group, group_dst=dst))
    return requests


def wait(requests: list) -> None:
    """Wait for every request of :func:`send_recv` (each raises after the group's timeout)."""
    for request in requests:
        request.wait()
