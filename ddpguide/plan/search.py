"""Every layout of a model on N GPUs, predicted by ``plan_cost.py`` and ``plan_step.py`` and ranked.

:func:`divides` holds the rules a layout's sizes obey (heads and key-value heads by tp,
layers by pp, the sequence by cp x tp and into 2 x cp zig-zag chunks, experts by ep);
:func:`sizes` lists the axis sizes that obey them on N ranks, :func:`layouts` every layout
with its micro-batches, schedules and checkpointing (the batch split by the data-parallel
ranks and the micro-batches); :func:`rank` predicts each one and orders the ones that fit
memory, with the allocator's headroom, by step time.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

from ddpguide.core import scratch
from ddpguide.launch.programs import ProgramRun, copy_program, load, path_of, run

#: the formulas (memory, compute, collectives)
PROGRAM = "plan_cost.py"
#: the step simulation, which imports them
STEP = "plan_step.py"
#: the microbenchmarks that write a machine's Hardware (``--measure``, ``--sweep``)
MEASURE = "plan_measure.py"
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
CHECKPOINTING = ("none", "selective", "full")
LABELS = {"pp": "PP", "dp_replicate": "DDP", "dp_shard": "FSDP", "cp": "CP", "ep": "EP", "tp": "TP"}


def program() -> ModuleType:
    """The chapter's cost model: ``book/programs/plan_step.py`` loaded with the ``plan_cost.py``
    it imports, as one module holding the names of both (``Model``, ``memory``, ``step``...).
    ``formulas`` is the loaded ``plan_cost`` itself: the module whose globals both programs call
    (:mod:`ddpguide.plan.perturb` changes a term there)."""
    step = load(STEP)
    formulas = step.plan_cost
    both = ModuleType("plan_model", step.__doc__)
    for module in (formulas, step):
        vars(both).update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    vars(both)["formulas"] = formulas
    return both


def run_step(*args: str, workdir: str | Path | None = None, program: str = STEP, **options: Any) -> ProgramRun:
    """``plan_step.py`` (or ``program``: :data:`MEASURE`) run as a reader runs it
    (:func:`ddpguide.launch.programs.run`), in a folder that holds the ``plan_cost.py`` it
    imports beside it."""
    folder = Path(workdir) if workdir else scratch.folder("ddpguide-plan-step-")
    copy_program(PROGRAM, folder)
    return run(program, *args, workdir=folder, **options)


def version() -> str:
    """The cost model's version: the first 12 hex digits of the SHA-256 of ``plan_cost.py``
    followed by ``plan_step.py``."""
    return hashlib.sha256(path_of(PROGRAM).read_bytes() + path_of(STEP).read_bytes()).hexdigest()[:12]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``world``."""
    if parts == 1:
        yield (world,)
        return
    for d in _divisors(world):
        for rest in factorizations(world // d, parts - 1):
            yield (d, *rest)


def divides(model: Any, axes: dict[str, int], seq: int) -> bool:
    """Whether axis sizes split the model and the sequence (an axis missing: size 1)."""
    pp, cp, ep, tp = (axes.get(a, 1) for a in ("pp", "cp", "ep", "tp"))
    kv = model.kv_heads or model.heads
    return not (model.heads % tp or kv % tp or model.ffn % tp or model.layers % pp or seq % (cp * tp)
                or (cp > 1 and seq % (2 * cp)) or (ep > 1 and (not model.experts or model.experts % ep)))


def sizes(p: ModuleType, model: Any, world: int, seq: int,
          axes: Iterable[str] | None = None) -> Iterator[dict[str, int]]:
    """Every split of ``world`` ranks over ``axes`` (default: all of the program's) that
    :func:`divides` the model, each axis of the program named."""
    chosen = tuple(axes or p.AXES)
    for parts in factorizations(world, len(chosen)):
        found = {a: 1 for a in p.AXES} | dict(zip(chosen, parts))
        if divides(model, found, seq):
            yield found


def layouts(p: ModuleType, model: Any, world: int, batch: int, seq: int, runnable: bool = False,
            microbatch_choices: int = 2, ac_choices: tuple[str, ...] = CHECKPOINTING) -> list[Any]:
    """Every layout of ``model`` on ``world`` ranks (``runnable``: only what train.py runs)."""
    out = []
    for axes in sizes(p, model, world, seq):
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


def plain(p: ModuleType, model: Any, world: int, batch: int, seq: int) -> list[Any]:
    """The layouts train.py runs with its defaults: 1F1B, the fewest micro-batches, no checkpointing."""
    return [lay for lay in layouts(p, model, world, batch, seq, runnable=True, microbatch_choices=1)
            if lay.ac == "none" and lay.schedule == "1F1B"]


def name(layout: Any) -> str:
    """``"PP 2 x FSDP 2 x TP 2, 1F1B m4, AC full"``."""
    axes = [(LABELS[a], size) for a, size in layout.sizes().items() if size > 1]
    if layout.dp_replicate > 1 and (layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1):
        axes = [("HSDP" if k == "DDP" else k, v) for k, v in axes]
    text = " x ".join(k for k, _ in axes) + " " + " x ".join(str(v) for _, v in axes)
    text = text.strip() or "1 process"
    if layout.pp > 1:
        text += f", {layout.schedule} m{layout.microbatches}"
    if layout.ac != "none":
        text += f", AC {layout.ac}"
    return text


def margin(peak: float, hardware: Any, headroom: float = 1.0) -> float:
    """The bytes left of the GPU's memory once the allocator holds ``headroom`` times the
    predicted peak (the layout fits where this is not negative)."""
    return hardware.memory - peak * headroom


def rank(p: ModuleType, model: Any, policy: Any, hardware: Any, world: int, batch: int, seq: int,
         runnable: bool = False, progress: Callable[[list[Any]], Iterable[Any]] | None = None,
         headroom: float = 1.0, **options: Any) -> list[dict[str, Any]]:
    """Each layout's prediction, the ones that fit first, fastest first. A layout fits when
    ``headroom`` times its predicted peak is within the GPU's memory (``margin``: what is left)."""
    rows = []
    candidates = layouts(p, model, world, batch, seq, runnable, **options)
    for layout in (progress(candidates) if progress else candidates):
        out = p.predict(model, layout, policy, hardware, batch, seq)
        left = margin(out["peak_memory"], hardware, headroom)
        rows.append({"layout": layout, "name": name(layout), "fits": left >= 0, "margin": left,
                     "headroom": headroom, **out})
    rows.sort(key=lambda r: (not r["fits"], r["step"]["total"]))
    return rows
