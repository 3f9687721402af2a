"""Per-rank memory of data parallelism with ZeRO: counted tensor by tensor, beside the paper's formulas.

The ZeRO paper (*ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models*) counts model state per parameter. Training in float32 with Adam, each
parameter costs 4 bytes of value, 4 of gradient and 8 of optimizer state (two
moments), 16 bytes in all. With N ranks:

* stage 0 (DDP) keeps all 16 on every rank;
* stage 1 divides the optimizer state by N: ``4 + 4 + 8/N``;
* stage 2 divides gradients too: ``4 + (4 + 8)/N``;
* stage 3 divides everything: ``16/N``.

:func:`count` measures what a rank really holds by adding up the bytes of its
local tensors (``to_local()`` of a DTensor); :func:`measure` does it for every
strategy on the ranks of a spawn. :func:`step_peaks` measures the memory *inside* a
step: the bytes alive at its peak, by kind, as PyTorch's own tracker counts them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpguide.core.models import mlp
from ddpguide.sharding.strategies import STRATEGIES, ZERO_STAGE, Trainer, build, on_rank_device

FP32_ADAM = {"params": 4, "grads": 4, "optimizer": 8}  # bytes per parameter
DIVIDED_BY_N = {0: (), 1: ("optimizer",), 2: ("grads", "optimizer"),
                3: ("params", "grads", "optimizer")}
KINDS = ("params", "grads", "optimizer")
MEMORY_WIDTHS = (64, 64, 64, 64, 64)  # 4 x Linear(64, 64): every tensor splits evenly up to 4 ranks
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2_hand": "ZeRO-2 (by hand)",
          "zero3_hand": "ZeRO-3 (by hand)", "fsdp2": "FSDP2", "single": "one process"}


def formula(stage: int, numel: int, world_size: int,
            bytes_per_parameter: dict[str, int] = FP32_ADAM) -> dict[str, float]:
    """The paper's bytes per rank for ``numel`` parameters at a ZeRO ``stage`` on ``world_size`` ranks."""
    if stage not in DIVIDED_BY_N:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return {kind: bytes_per_parameter[kind] * numel / (world_size if kind in DIVIDED_BY_N[stage] else 1)
            for kind in KINDS}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the elements of ``tensors`` (what they hold, not their allocator's rounding)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def count(trainer: Trainer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state.

    ``optimizer_counters`` is the part of ``optimizer`` held in scalars
    (Adam's per-tensor ``step``), which the paper's formula leaves out.
    """
    local = trainer.local_tensors()
    out = {kind: tensor_bytes(local[kind]) for kind in KINDS}
    out["optimizer_counters"] = tensor_bytes(t for t in local["optimizer"] if t.dim() == 0)
    return out


def measure(strategies: Sequence[str] = ("ddp", "zero1", "zero2_hand", "zero3_hand", "fsdp2"),
            widths: Sequence[int] = MEMORY_WIDTHS, batch: int = 8, seed: int = 0) -> list[dict]:
    """On each rank of a spawn: one float32 Adam step per strategy, then :func:`count`.

    Counting after the step measures the state a rank keeps *between* steps;
    the gathered parameters of ZeRO-3 exist only inside a step.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    inputs, targets = on_rank_device(torch.randn(batch, widths[0]), torch.randn(batch, widths[-1]))
    records = []
    for name in strategies:
        torch.manual_seed(seed)
        model = mlp(tuple(widths), dtype=torch.float32)
        numel = sum(p.numel() for p in model.parameters())
        tensors = len(list(model.parameters()))
        trainer = build(name, model)
        trainer.step(inputs, targets, nn.functional.mse_loss)
        records.append({"strategy": name, "stage": ZERO_STAGE[name], "world_size": world,
                        "rank": rank, "numel": numel, "tensors": tensors, **count(trainer),
                        "formula": formula(ZERO_STAGE[name], numel, world)})
        dist.barrier()
    return records


def step_peaks(strategies: Sequence[str] = ("ddp", "zero1", "zero2_hand", "zero3_hand", "fsdp2"),
               widths: Sequence[int] = MEMORY_WIDTHS, batch: int = 8, seed: int = 0) -> list[dict]:
    """On each rank of a spawn: the bytes alive at the peak of one float32 Adam step, by kind.

    Counted by ``torch.distributed._tools``' ``MemTracker`` (``FSDPMemTracker`` for FSDP2,
    which also names the gathered parameters and the all-gather and reduce-scatter
    buffers): every tensor of the model and optimizer (and the shards of the hand-written
    ZeRO, which the optimizer updates: "Other") and every tensor the step creates, while it
    lives. The step counted is the third (the first makes Adam's state; DDP
    rebuilds its buckets in the second). DDP's flat gradient buckets, made before, are
    outside the tracker's view: ``ddp_buckets`` adds their bytes from DDP's own record.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    inputs, targets = on_rank_device(torch.randn(batch, widths[0]), torch.randn(batch, widths[-1]))
    records = []
    for name in strategies:
        torch.manual_seed(seed)
        trainer = build(name, mlp(tuple(widths), dtype=torch.float32))
        for _ in range(2):
            trainer.step(inputs, targets, nn.functional.mse_loss)
        tracker: MemTracker
        if name == "fsdp2":
            tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
        else:
            tracker = MemTracker()  # the hand-written shards are the optimizer's, not the model's
            shards = [sh.shard for sh in trainer.sharded.shards] if trainer.sharded is not None else []
            tracker.track_external(trainer.model, trainer.optimizer, *shards)
        with tracker:
            trainer.step(inputs, targets, nn.functional.mse_loss)
        (peak,) = tracker.get_tracker_snapshot("peak").values()  # one device
        buckets = trainer.model._get_ddp_logging_data().get("bucket_sizes", "") \
            if isinstance(trainer.model, DDP) else ""
        records.append({"strategy": name, "world_size": world, "rank": rank,
                        "kinds": {getattr(kind, "value", kind): n for kind, n in peak.items()},
                        "ddp_buckets": sum(int(b) for b in str(buckets).split(",") if b),
                        "between_steps": sum(v for k, v in count(trainer).items() if k in KINDS),
                        "layer_bytes": tensor_bytes(mlp(tuple(widths[:2]), dtype=torch.float32).parameters())})
        dist.barrier()
    return records


def peak_table(records: Sequence[dict], rank: int = 0) -> list[dict]:
    """One row per (strategy, world size): rank ``rank``'s state between steps and its peak
    inside a step, in KiB, with the parameters held at the peak (full or gathered)."""
    rows = []
    for r in records:
        if r["rank"] != rank:
            continue
        kinds = r["kinds"]
        gathered = kinds.get("Unsharded Param", kinds.get("Parameter", 0))
        rows.append({"strategy": LABELS.get(r["strategy"], r["strategy"]), "ranks": r["world_size"],
                     "between steps KiB": _kib(r["between_steps"]),
                     "peak in the step KiB": _kib(kinds["Total"] + r["ddp_buckets"]),
                     "of it: parameters KiB": _kib(gathered + kinds.get("Sharded Param", kinds.get("Other", 0))),
                     "gathered layers": round(kinds["Unsharded Param"] / r["layer_bytes"], 2)
                     if "Unsharded Param" in kinds else "-",
                     "DDP buckets KiB": _kib(r["ddp_buckets"])})
    return rows


def table(records: Sequence[dict], rank: int = 0) -> list[dict]:
    """One row per (strategy, world size), as rank ``rank`` counted it, in KiB."""
    rows = []
    for r in records:
        if r["rank"] != rank:
            continue
        measured = sum(r[k] for k in KINDS)
        expected = sum(r["formula"].values())
        rows.append({
            "strategy": LABELS.get(r["strategy"], r["strategy"]), "ranks": r["world_size"],
            "params KiB": _kib(r["params"]), "grads KiB": _kib(r["grads"]),
            "optimizer KiB": _kib(r["optimizer"]), "total KiB": _kib(measured),
            "paper KiB": _kib(expected),
            "measured - paper (bytes)": int(measured - expected),
            "Adam step counters (bytes)": r["optimizer_counters"],
        })
    return rows


def _kib(n: float) -> float:
    return round(n / 1024, 2)


def plot(records: Sequence[dict], rank: int = 0):
    """Stacked bars per strategy and world size, with the paper's totals marked."""
    import matplotlib.pyplot as plt

    mine = [r for r in records if r["rank"] == rank]
    strategies = [s for s in STRATEGIES if any(r["strategy"] == s for r in mine)]
    worlds = sorted({r["world_size"] for r in mine})
    width = 0.8 / len(worlds)
    colours = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, name in enumerate(strategies):
        for j, world in enumerate(worlds):
            (r,) = [r for r in mine if r["strategy"] == name and r["world_size"] == world]
            x = i + (j - (len(worlds) - 1) / 2) * width
            bottom = 0.0
            for kind in KINDS:
                label = kind if i == 0 and j == 0 else None
                ax.bar(x, r[kind] / 1024, width * 0.9, bottom=bottom, color=colours[kind], label=label)
                bottom += r[kind] / 1024
            paper = sum(r["formula"].values()) / 1024
            ax.plot([x - width / 2, x + width / 2], [paper, paper], "k-", lw=1.5,
                    label="paper's formula" if i == 0 and j == 0 else None)
            ax.text(x, bottom, f"N={world}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(strategies)), [LABELS[s] for s in strategies])
    ax.set(ylabel=f"KiB per rank (rank {rank})",
           title="Model state per rank after one Adam step (float32)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=4, loc="upper center")
    fig.tight_layout()
    return fig
