"""A layout, a model and a dtype as the capstone's ``train.py`` takes them, in one place.

:func:`options` is a layout's options (``--pp 2 --dp-shard 2 --microbatches 4 ...``);
:func:`model_options` the model's shape, the sequence, the batch and the dtype;
:func:`command` the ``torchrun`` lines that run them: one a node, for exactly the layout's
ranks; :func:`chosen` the row whose lines ``python -m ddpguide.plan`` prints. What
``train.py`` cannot run (selective checkpointing, the interleaved schedule, a
model other than its own GPT, float8) is refused with the reason (:class:`Unrunnable`).
"""

from __future__ import annotations

from typing import Any

PROGRAM = "train.py"
#: the dtype policies of :data:`catalog.POLICIES` as train.py's options
DTYPES: dict[str, tuple[str, ...]] = {"float32": ("--dtype", "float32"), "float64": ("--dtype", "float64"),
                                      "bf16": ("--dtype", "float32", "--bf16")}


class Unrunnable(ValueError):
    """What the planner predicted is not a run ``train.py`` makes; the message says why."""


def _flag(axis: str) -> str:
    return f"--{axis.replace('_', '-')}"


def options(layout: Any) -> tuple[str, ...]:
    """``train.py``'s options for a layout. With accumulation, ``--batch`` is each accumulation
    step's (:func:`model_options`)."""
    if layout.ac == "selective":
        raise Unrunnable(f"{PROGRAM} checkpoints whole blocks only (--checkpoint-activations), not selectively")
    if layout.schedule not in ("1F1B", "GPipe") and layout.pp > 1:
        raise Unrunnable(f"{PROGRAM} runs the schedules 1F1B and GPipe, not {layout.schedule}")
    if layout.zero:
        raise Unrunnable(f"{PROGRAM} has no ZeRO-{layout.zero} (its sharding is FSDP's: --dp-shard)")
    out: list[str] = []
    for axis, size in layout.sizes().items():
        if size > 1:
            out += [_flag(axis), str(size)]
    if layout.pp > 1:
        out += ["--microbatches", str(layout.microbatches), "--schedule", layout.schedule]
    if layout.accumulate > 1:
        out += ["--accumulate", str(layout.accumulate)]
    if layout.ac == "full":
        out.append("--checkpoint-activations")
    return tuple(out)


def model_options(model: Any, seq: int, batch: int, dtype: str) -> tuple[str, ...]:
    """``train.py``'s options for the model (its vocabulary is bytes: 256), the sequence,
    ``batch`` (the sequences of one accumulation step, all ranks) and a dtype policy's name."""
    if (model.vocab != 256 or model.gated or not model.tied or model.shared or model.mask
            or model.ffn % model.dim):
        raise Unrunnable(f"{PROGRAM} trains its own GPT only: vocabulary 256, GELU, tied, no shared "
                         "experts, a causal kernel, an MLP a multiple of the width wide")
    if dtype not in DTYPES:
        raise Unrunnable(f"{PROGRAM} computes in {', '.join(DTYPES)}, not {dtype}")
    out = ["--layers", str(model.layers), "--dim", str(model.dim), "--heads", str(model.heads),
           "--ffn", str(model.ffn // model.dim), "--seq", str(seq), "--batch", str(batch), *DTYPES[dtype]]
    if model.kv_heads and model.kv_heads != model.heads:
        out += ["--kv-heads", str(model.kv_heads)]
    if model.experts:
        out += ["--experts", str(model.experts), "--top-k", str(model.top_k)]
    return tuple(out)


def nodes(world: int, gpus_per_node: int) -> int:
    """The nodes ``world`` ranks fill, whole ones only (:class:`Unrunnable` otherwise)."""
    if world > gpus_per_node and world % gpus_per_node:
        raise Unrunnable(f"{world} GPUs do not fill whole nodes of {gpus_per_node}")
    return max(1, world // gpus_per_node)


def command(layout: Any, gpus_per_node: int, model: Any, seq: int, batch: int, dtype: str) -> list[str]:
    """The lines that run ``layout`` of ``model`` with ``book/programs/gpt/train.py``: one
    ``torchrun`` a node (a single node: ``--standalone``), ``batch`` the step's sequences."""
    shape = model_options(model, seq, batch // layout.accumulate, dtype)  # the model first: the larger reason
    tail = " ".join((*options(layout), *shape))
    count = nodes(layout.world, gpus_per_node)
    if count == 1:
        return [f"torchrun --standalone --nproc-per-node {layout.world} {PROGRAM} {tail}"]
    return [f"torchrun --nnodes {count} --node-rank {r} --nproc-per-node {gpus_per_node} "
            f"--rdzv-backend c10d --rdzv-endpoint NODE0:29500 {PROGRAM} {tail}" for r in range(count)]


def chosen(rows: list[dict[str, Any]], gpus_per_node: int, model: Any, seq: int, batch: int,
           dtype: str) -> tuple[dict[str, Any] | None, list[str], str | None]:
    """The first ranked row that fits and that ``train.py`` runs, with its :func:`command`
    (``None`` and no lines where none does), and why the best fitting row is not it (``None``
    when it is): what ``python -m ddpguide.plan`` prints."""
    why = None
    for row in (r for r in rows if r["fits"]):
        try:
            return row, command(row["layout"], gpus_per_node, model, seq, batch, dtype), why
        except Unrunnable as refused:
            why = why or str(refused)
    return None, [], why
