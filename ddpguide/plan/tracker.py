"""torch's own memory trackers on the capstone GPT: ``FSDPMemTracker`` and ``MemTracker``.

``torch.distributed._tools`` (torch 2.14.1) tracks every tensor a module, its optimizer and
autograd allocate, by kind, through a ``TorchDispatchMode``; it needs no GPU. :func:`peak`
runs one training step of ``gpt/model.py`` put on a layout by ``gpt/parallelize.py`` (the
chapter-14 program's own functions) on spawned ranks, the second step under the tracker
(the first builds AdamW's state), and returns each rank's peak snapshot: bytes by kind at
the moment the total peaked. FSDP layouts get ``FSDPMemTracker`` (sharded and unsharded
parameters and gradients, all-gather and reduce-scatter buffers told apart), the others
``MemTracker``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ddpguide.launch.programs import load
from ddpguide.launch.spawn import spawn


def _worker(axes: dict, config: dict, seq: int, batch: int, timeout: float) -> dict:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    gpt, par = load("gpt/model.py"), load("gpt/parallelize.py")
    torch.set_default_dtype(torch.float64)
    layout = par.Layout(**axes)
    mesh = par.build_mesh(layout, "cpu", datetime.timedelta(seconds=timeout))  # every group's timeout
    torch.manual_seed(0)
    model = gpt.GPT(gpt.Config(seq=seq, **config))
    stage = par.parallelize(model, layout, mesh, torch.device("cpu"))
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    rows, cols = batch // layout.data_parallel, seq // layout.cp
    dp, cp = mesh["fsdp"].get_local_rank() if layout.dp_shard > 1 else 0, mesh["cp"].get_local_rank()
    data = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x = data[dp * rows:(dp + 1) * rows, cp * cols:(cp + 1) * cols]
    y = data[dp * rows:(dp + 1) * rows, cp * cols + 1:(cp + 1) * cols + 1]

    def step() -> None:
        gpt.loss_of(stage(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    step()
    tracker: MemTracker
    if hasattr(stage, "reshard"):  # an FSDP module
        tracker = FSDPMemTracker(stage, optimizer)
        tracker.track_inputs((x, y))
    else:
        tracker = MemTracker()
        tracker.track_external(stage, optimizer)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    dist.barrier()
    return {"tracker": type(tracker).__name__, **{str(getattr(k, "value", k)): v for k, v in snapshot.items()}}


def peak(axes: dict, config: dict, seq: int, batch: int, timeout: float = 300.0) -> list[dict]:
    """Each rank's peak snapshot (bytes by kind, and 'Total') of the second training step."""
    world = 1
    for size in axes.values():
        world *= size
    return spawn(_worker, world, axes, config, seq, batch, timeout, timeout=timeout, threads_per_rank=1,
                 echo=False)


def predicted_over_tracked(p: ModuleType, model: Any, layout: Any, policy: Any, seq: int, batch: int,
                           snaps: list[dict]) -> float:
    """The planner's simultaneous peak (``at_peak`` of ``memory``) at its busiest rank over the
    largest peak torch's tracker saw at any rank (``peak``'s snapshots of the same layout)."""
    predicted = max(sum(p.at_peak(model, layout, policy, batch, seq, r).values())
                    for r in range(layout.world))
    return predicted / max(s["Total"] for s in snaps)
