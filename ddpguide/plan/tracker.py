"""torch's own memory trackers on the capstone GPT: ``FSDPMemTracker`` and ``MemTracker``.

``torch.distributed._tools`` (torch 2.14.1) tracks every tensor a module, its optimizer and
autograd allocate, by kind, through a ``TorchDispatchMode``; it needs no GPU. :func:`peak`
runs one training step of ``gpt/model.py`` put on a layout by ``gpt/parallelize.py`` (the
chapter-14 program's own functions) on spawned ranks, the second step under the tracker
(the first builds AdamW's state), and returns each rank's peak snapshot: bytes by kind at
the moment the total peaked. FSDP layouts get ``FSDPMemTracker`` (sharded and unsharded
parameters and gradients, all-gather and reduce-scatter buffers told apart), the others
``MemTracker``.

Each layout runs as ``train.py`` runs it: TP's loss under ``loss_parallel`` (the logits split
by vocabulary), CP's two zig-zag chunks of each sequence, a pipeline's micro-batches under
torch's ``Schedule1F1B`` or ``ScheduleGPipe``. A pipeline calls its stage once a micro-batch,
which both trackers refuse as a second iteration (``NotImplementedError``: "multiple iterative
calls"); the stage's own statistics are dropped before each call, the tracker's peak is kept.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from ddpguide.launch.programs import load
from ddpguide.launch.spawn import spawn


def _worker(axes: dict, config: dict, seq: int, batch: int, timeout: float, microbatches: int = 0,
            schedule: str = "1F1B") -> dict:
    import contextlib
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor.parallel import loss_parallel

    gpt, par = load("gpt/model.py"), load("gpt/parallelize.py")
    torch.set_default_dtype(torch.float64)
    layout = par.Layout(**axes)
    mesh = par.build_mesh(layout, "cpu", datetime.timedelta(seconds=timeout))  # every group's timeout
    torch.manual_seed(0)
    model = gpt.GPT(gpt.Config(seq=seq, **config))
    stage = par.parallelize(model, layout, mesh, torch.device("cpu"))
    part = getattr(stage, "module", stage)  # DDP's module
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    # this rank's rows and tokens, as train.py takes them (its place among the data-parallel
    # ranks; two chunks of each sequence under CP)
    rows = batch // layout.data_parallel
    dp = ((mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank())
          * layout.ep + mesh["ep"].get_local_rank())
    cols = (gpt.zigzag(mesh["cp"].get_local_rank(), layout.cp, seq) if layout.cp > 1 else torch.arange(seq))
    data = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = data[dp * rows:(dp + 1) * rows, :-1][:, cols], data[dp * rows:(dp + 1) * rows, 1:][:, cols]
    parallel_loss = loss_parallel if layout.tp > 1 else contextlib.nullcontext  # TP's split logits
    pipeline = None
    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        m = microbatches or 2 * layout.pp
        pipe = PipelineStage(stage, mesh["pp"].get_local_rank(), layout.pp, torch.device("cpu"),
                             group=mesh["pp"].get_group())
        pipeline = (Schedule1F1B if schedule == "1F1B" else ScheduleGPipe)(
            pipe, m, loss_fn=lambda out, target: gpt.loss_of(out, target) / m, scale_grads=False)

    def step() -> None:
        with parallel_loss():
            if pipeline is None:
                gpt.loss_of(stage(x), y).backward()
            else:
                pipeline.step(x if part.embeds else None, target=y if part.outputs else None)
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
    # a pipeline calls its stage once a micro-batch, which both trackers take for the next
    # step and refuse ("multiple iterative calls"): the stage's own statistics are dropped
    # before each call (the peak is the tracker's, kept across them). A global hook registered
    # before the tracker's runs first, and before FSDP's own pre-forward.
    def again(module: torch.nn.Module, args: Any) -> None:
        if module is stage:
            tracker.memory_tracking.pop(module, None)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(again) if pipeline else None
    try:
        with tracker:
            step()
    finally:
        if hook is not None:
            hook.remove()
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    dist.barrier()
    return {"tracker": type(tracker).__name__, **{str(getattr(k, "value", k)): v for k, v in snapshot.items()}}


def peak(axes: dict, config: dict, seq: int, batch: int, timeout: float = 300.0, microbatches: int = 0,
         schedule: str = "1F1B") -> list[dict]:
    """Each rank's peak snapshot (bytes by kind, and 'Total') of the second training step; a
    pipeline runs ``microbatches`` (0: train.py's default, 2 x pp) under ``schedule``."""
    world = 1
    for size in axes.values():
        world *= size
    return spawn(_worker, world, axes, config, seq, batch, timeout, microbatches, schedule, timeout=timeout,
                 threads_per_rank=1, echo=False)


def predicted_over_tracked(p: ModuleType, model: Any, layout: Any, policy: Any, seq: int, batch: int,
                           snaps: list[dict]) -> float:
    """The planner's simultaneous peak (``at_peak`` of ``memory``) at its busiest rank over the
    largest peak torch's tracker saw at any rank (``peak``'s snapshots of the same layout)."""
    predicted = max(sum(p.at_peak(model, layout, policy, batch, seq, r).values())
                    for r in range(layout.world))
    return predicted / max(s["Total"] for s in snaps)


def every_layout(p: ModuleType, seq: int, batch: int, world: int = 4,
                 say: Callable[[str], None] = lambda line: None) -> dict[str, float]:
    """:func:`predicted_over_tracked` for every layout of the checks' GPT (float64) on ``world``
    ranks, by layout name; ``say`` gets a line for each as it is measured."""
    from ddpguide.plan import catalog, search

    model, policy = catalog.model(p, "gpt-check"), catalog.policy(p, "float64")
    config = dict(dim=model.dim, heads=model.heads, layers=model.layers)
    out = {}
    for lay in search.plain(p, model, world, batch, seq):
        snaps = peak({a: n for a, n in lay.sizes().items() if n > 1}, config, seq, batch,
                     microbatches=lay.microbatches, schedule=lay.schedule)
        out[search.name(lay)] = predicted_over_tracked(p, model, lay, policy, seq, batch, snaps)
        say(f"{search.name(lay)}: predicted peak / {snaps[0]['tracker']} {out[search.name(lay)]:.3f}")
    return out
