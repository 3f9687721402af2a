"""Every layout of a model on N GPUs, predicted by ``plan_cost.py`` and ranked.

:func:`layouts` lists the layouts that divide the model (heads and key-value heads by tp,
layers by pp, the sequence by cp x tp and into 2 x cp zig-zag chunks, experts by ep, the
batch by the data-parallel ranks and the micro-batches); :func:`rank` predicts each one and
orders the ones that fit memory by step time; :func:`command` is the ``torchrun`` line that
runs a layout with the capstone's ``train.py`` (what that program can run: schedules 1F1B
and GPipe, full checkpointing).
"""

from __future__ import annotations

import itertools
import math
from types import ModuleType
from typing import Callable, Iterator

from ddpguide.launch.programs import load

PROGRAM = "plan_cost.py"
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
CHECKPOINTING = ("none", "selective", "full")
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")


def program() -> ModuleType:
    """The chapter's cost model, loaded from ``book/programs/plan_cost.py``."""
    return load(PROGRAM)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int, parts: int = len(AXES)) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``world``."""
    if parts == 1:
        yield (world,)
        return
    for d in _divisors(world):
        for rest in factorizations(world // d, parts - 1):
            yield (d, *rest)


def layouts(p: ModuleType, model, world: int, batch: int, seq: int, runnable: bool = False,
            microbatch_choices: int = 2, ac_choices=CHECKPOINTING) -> list:
    """Every layout of ``model`` on ``world`` ranks (``runnable``: only what train.py runs)."""
    out = []
    kv = model.kv_heads or model.heads
    for sizes in factorizations(world):
        axes = dict(zip(AXES, sizes))
        if (model.heads % axes["tp"] or kv % axes["tp"] or model.layers % axes["pp"]
                or seq % (axes["cp"] * axes["tp"]) or model.ffn % axes["tp"]
                or (axes["cp"] > 1 and seq % (2 * axes["cp"]))
                or (axes["ep"] > 1 and (not model.experts or model.experts % axes["ep"]))):
            continue
        if runnable and model.experts and axes["tp"] > 1:
            continue
        dp = axes["dp_replicate"] * axes["dp_shard"] * axes["ep"]
        if batch % dp:
            continue
        local = batch // dp
        if axes["pp"] == 1:
            counts, schedules = [1], ["1F1B"]
        else:
            counts = [m for m in _divisors(local) if m >= axes["pp"]][:microbatch_choices]
            schedules = ["1F1B", "GPipe"] if runnable else list(SCHEDULES)
            if model.layers % (2 * axes["pp"]):
                schedules = [s for s in schedules if s != "Interleaved1F1B"]
        checkpointing = ("none", "full") if runnable else ac_choices
        for m, schedule, ac in itertools.product(counts, schedules, checkpointing):
            out.append(p.Layout(**axes, microbatches=m, schedule=schedule, ac=ac))
    return out


def plain(p: ModuleType, model, world: int, batch: int, seq: int) -> list:
    """The layouts train.py runs with its defaults: 1F1B, the fewest micro-batches, no checkpointing."""
    return [lay for lay in layouts(p, model, world, batch, seq, runnable=True, microbatch_choices=1)
            if lay.ac == "none" and lay.schedule == "1F1B"]


def name(layout) -> str:
    """``"PP 2 x FSDP 2 x TP 2, 1F1B m4, AC full"``."""
    labels = {"pp": "PP", "dp_replicate": "DDP", "dp_shard": "FSDP", "cp": "CP", "ep": "EP", "tp": "TP"}
    axes = [(labels[a], getattr(layout, a)) for a in AXES if getattr(layout, a) > 1]
    if layout.dp_replicate > 1 and (layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1):
        axes = [("HSDP" if k == "DDP" else k, v) for k, v in axes]
    text = " x ".join(k for k, _ in axes) + " " + " x ".join(str(v) for _, v in axes)
    text = text.strip() or "1 process"
    if layout.pp > 1:
        text += f", {layout.schedule} m{layout.microbatches}"
    if layout.ac != "none":
        text += f", AC {layout.ac}"
    return text


def rank(p: ModuleType, model, policy, hardware, world: int, batch: int, seq: int,
         runnable: bool = False, progress: Callable | None = None, **options) -> list[dict]:
    """Each layout's prediction, the ones that fit first, fastest first."""
    rows = []
    candidates = layouts(p, model, world, batch, seq, runnable, **options)
    for layout in (progress(candidates) if progress else candidates):
        out = p.predict(model, layout, policy, hardware, batch, seq)
        rows.append({"layout": layout, "name": name(layout), "fits": out["peak_memory"] <= hardware.memory,
                     **out})
    rows.sort(key=lambda r: (not r["fits"], r["step"]["total"]))
    return rows


def command(layout, gpus_per_node: int, model_options: tuple[str, ...] = ()) -> list[str]:
    """The lines that run ``layout`` with ``book/programs/gpt/train.py``: one ``torchrun``
    a node (a single node: ``--standalone``)."""
    options = [f"--{a.replace('_', '-')} {getattr(layout, a)}" for a in AXES if getattr(layout, a) > 1]
    if layout.pp > 1:
        schedule = "1F1B" if layout.schedule == "Interleaved1F1B" else layout.schedule
        options += [f"--microbatches {layout.microbatches}", f"--schedule {schedule}"]
    if layout.ac == "full":
        options.append("--checkpoint-activations")
    tail = " ".join([*options, *model_options])
    world = layout.world
    notes = []
    if layout.ac == "selective" or layout.schedule == "Interleaved1F1B":
        notes = ["# train.py has neither selective checkpointing nor the interleaved schedule: "
                 "this line runs the nearest it has"]
    if world <= gpus_per_node:
        return [f"torchrun --standalone --nproc-per-node {world} train.py {tail}".rstrip(), *notes]
    nodes = math.ceil(world / gpus_per_node)
    return [f"torchrun --nnodes {nodes} --node-rank {r} --nproc-per-node {gpus_per_node} "
            f"--rdzv-backend c10d --rdzv-endpoint NODE0:29500 train.py {tail}".rstrip()
            for r in range(nodes)] + notes
