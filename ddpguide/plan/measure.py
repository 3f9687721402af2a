"""What the planner's checks measure: the hardware's inputs (microbenchmarks only) and the
capstone's ``train.py`` on a layout (its own counting of memory, its step).

:func:`hardware` runs ``plan_cost.py --measure`` (matmul rate per shape, memory bandwidth, the
time of one small operation, the cores the ranks get when all are busy) and ``plan_cost.py
--sweep`` under ``torchrun`` (alpha, beta and burst of gloo's all-reduce), on this machine's
loopback or across chapter 15's emulated cluster (:func:`cluster_hardware`).
:func:`run_layout` runs ``gpt/train.py --cost`` on a layout and returns its ``cost`` record
(:func:`run_on_cluster`: the same under ``torchrun --nnodes`` on the cluster's nodes);
:func:`options` turns a ``plan_cost.Layout`` into the program's options.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from types import ModuleType

from ddpguide.core import scratch
from ddpguide.gpt import cost as gpt_cost
from ddpguide.gpt.layouts import PROGRAM as TRAIN
from ddpguide.launch.programs import path_of, run, torchrun
from ddpguide.launch.report import ReportError

MEMORY = ("parameters", "gradients", "optimizer", "activations")


def hardware(p: ModuleType, which: str = "this-machine", ranks: int = 4, folder: Path | None = None,
             cores_note: str = ""):
    """This machine's ``plan_cost.Hardware``, measured now (``which``: ``this-machine``, or a
    JSON file written by ``plan_cost.py --measure``)."""
    if which.endswith(".json"):
        return p.Hardware(**json.loads(Path(which).read_text()))
    if which != "this-machine":
        raise ValueError(f"hardware {which!r}: this-machine, or cluster_hardware for the emulated cluster")
    folder = Path(folder or scratch.folder("ddpguide-plan-"))
    path = folder / "hw.json"
    run("plan_cost.py", "--measure", str(path), "--ranks", str(ranks), echo=False, timeout=300,
        workdir=folder / "measure")
    run("plan_cost.py", "--sweep", str(path), launcher=torchrun(ranks), echo=False, timeout=300,
        workdir=folder / "sweep", env={"OMP_NUM_THREADS": "1"})
    hw = p.Hardware(**json.loads(path.read_text()))
    hw.gpus_per_node = max(hw.gpus_per_node, ranks)
    return hw


def options(layout) -> tuple[str, ...]:
    """``train.py``'s options for a layout (``--pp 2 --dp-shard 2 --microbatches 4 ...``). With
    accumulation, ``--batch`` is each accumulation step's (:func:`model_options`)."""
    out: list[str] = []
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp"):
        if getattr(layout, axis) > 1:
            out += [f"--{axis.replace('_', '-')}", str(getattr(layout, axis))]
    if layout.pp > 1:
        out += ["--microbatches", str(layout.microbatches), "--schedule", layout.schedule]
    if layout.accumulate > 1:
        out += ["--accumulate", str(layout.accumulate)]
    if layout.ac == "full":
        out.append("--checkpoint-activations")
    if layout.ac == "selective":
        raise ValueError("train.py checkpoints whole blocks only (--checkpoint-activations)")
    return tuple(out)


def model_options(model, seq: int, batch: int, dtype: str) -> tuple[str, ...]:
    """``train.py``'s options for the model (its vocabulary is bytes: 256; ``batch``: the
    sequences of one accumulation step)."""
    if (model.vocab != 256 or model.gated or not model.tied or model.shared or model.mask
            or model.ffn % model.dim):
        raise ValueError("train.py trains its own GPT only: vocabulary 256, GELU, tied, no shared "
                         "experts, a causal kernel, an MLP a multiple of the width wide")
    out = ["--layers", str(model.layers), "--dim", str(model.dim), "--heads", str(model.heads),
           "--ffn", str(model.ffn // model.dim), "--seq", str(seq), "--batch", str(batch),
           "--dtype", dtype]
    if model.kv_heads and model.kv_heads != model.heads:
        out += ["--kv-heads", str(model.kv_heads)]
    if model.experts:
        out += ["--experts", str(model.experts), "--top-k", str(model.top_k)]
    return tuple(out)


def run_layout(layout, model, seq: int, batch: int, dtype: str, steps: int = 3,
               timeout: float = 600.0, cache: str | None = None) -> dict:
    """``train.py --cost`` on the layout: the record of its ``cost:`` line (memory counted by
    every rank, the median step). ``cache``: a folder where each finished run is kept and
    from which the same run is read back instead of run again. Its callers read the memory
    counted, which the allocator's settings do not change: the ranks run with one thread
    and no ``MALLOC_*`` tunable, so that the package tests may fork them warm
    (:mod:`ddpguide.launch.warm`); the timed runs are :func:`run_on_cluster`'s."""
    extra = (*model_options(model, seq, batch // layout.accumulate, dtype), "--steps", str(steps), "--clip", "1.0")
    env = {"OMP_NUM_THREADS": "1"}
    saved = None
    if cache is not None:  # an interrupted benchmark resumes from the runs it finished
        key = hashlib.sha256(" ".join((*options(layout), *extra)).encode()).hexdigest()[:16]
        saved = Path(cache) / f"{key}.json"
        if saved.is_file():
            return json.loads(saved.read_text())
    result, _ = gpt_cost.measure(options(layout), layout.world, extra=extra, timeout=timeout, env=env)
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(result))
    return result


def counted(memory: dict) -> int:
    """The parts of a rank's memory ``train.py --cost`` counts (the planner predicts more:
    FSDP's unsharded buffers and communication buffers, which the program does not count)."""
    return sum(memory[k] for k in MEMORY)


def memory_ratios(p: ModuleType, layout, model, policy, seq: int, batch: int, result: dict) -> dict:
    """Predicted over counted memory (the parts train.py counts): at the peak rank, the rank
    furthest off, and all ranks together (``mean``). Under EP the rows each rank's experts
    get depend on the routing; the prediction is the balanced share, so only ``mean`` is
    its check there (``check``: the ratio to hold to, ``peak`` elsewhere)."""
    predicted = [counted(p.memory(model, layout, policy, batch, seq, r)) for r in range(layout.world)]
    measured = [counted(m) for m in result["memory"]]
    per_rank = [a / b for a, b in zip(predicted, measured)]
    mean = sum(predicted) / sum(measured)
    return {"peak": max(predicted) / max(measured), "worst_rank": max(per_rank, key=lambda r: abs(r - 1)),
            "mean": mean, "check": mean if layout.ep > 1 else max(predicted) / max(measured),
            "predicted": max(predicted), "measured": max(measured)}


def cluster_hardware(p: ModuleType, cluster, folder: Path | None = None, seconds: float | None = None,
                     repeats: int | None = None):
    """The hardware of a running emulated cluster: matmul rates, bandwidth and the cores its
    ranks get (``--measure --ranks`` all of them, on the host: the nodes share its cores), and
    each link level from ``--sweep`` across the nodes. A node's ranks share its one link.
    ``seconds`` and ``repeats``: the program's ``--seconds`` and ``--repeats`` (None: its
    defaults)."""
    from ddpguide.cluster.launch import torchrun_on

    folder = Path(folder or scratch.folder("ddpguide-plan-cluster-"))
    path = folder / "hw.json"
    ranks = cluster.spec.nodes * cluster.spec.ranks_per_node
    timing = ["--seconds", f"{seconds:g}"] if seconds is not None else []
    sizes = ["--repeats", str(repeats)] if repeats is not None else []
    run("plan_cost.py", "--measure", str(path), "--ranks", str(ranks), *timing, echo=False, timeout=300,
        workdir=folder / "measure")
    ended = torchrun_on(cluster, [str(path_of("plan_cost.py")), "--sweep", str(path), *sizes], 300, cwd=folder)
    failed = [(e.errors.strip().splitlines() or [f"exit {e.returncode}"])[-1] for e in ended if e.returncode != 0]
    if failed:
        raise RuntimeError("plan_cost.py --sweep on the cluster: " + " | ".join(failed))
    hw = p.Hardware(**json.loads(path.read_text()))
    hw.name = f"cluster {cluster.spec.nodes} x {cluster.spec.ranks_per_node}, {cluster.spec.link}"
    hw.nics, hw.overlap = 1, True  # one link a node, shared by its ranks; DDP's all-reduce waits on it
    hw.gpus_per_node = cluster.spec.ranks_per_node
    return hw


def run_on_cluster(cluster, layout, model, seq: int, batch: int, dtype: str, steps: int = 5,
                   timeout: float = 900.0, cache: str | None = None) -> dict:
    """``train.py --cost`` on the layout across the cluster's nodes (one ``torchrun --nnodes`` a
    node, as chapter 15 starts programs): the ``cost`` record of its report. ``cache`` as in
    :func:`run_layout` (the link rate is part of the key)."""
    from ddpguide.cluster.launch import torchrun_on

    extra = (*model_options(model, seq, batch // layout.accumulate, dtype), "--steps", str(steps), "--clip", "1.0")
    saved = None
    if cache is not None:
        key = " ".join((*options(layout), *extra, cluster.spec.link, str(cluster.spec.nodes)))
        saved = Path(cache) / f"cluster-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        if saved.is_file():
            return json.loads(saved.read_text())
    with tempfile.TemporaryDirectory(prefix="ddpguide-plan-run-") as folder:
        report = Path(folder, "report.json")
        program = [str(path_of(TRAIN)), *options(layout), *extra, "--cost", "--report", str(report)]
        ended = torchrun_on(cluster, program, timeout, cwd=folder)
        if any(e.returncode != 0 for e in ended) or not report.is_file():
            tails = [f"node{k}: exit {e.returncode}: {(e.errors.strip().splitlines() or [''])[-1]}"
                     for k, e in enumerate(ended) if e.returncode != 0] or ["no report written"]
            raise ReportError(f"{TRAIN} {' '.join(options(layout))} on the cluster: " + "; ".join(tails))
        result = json.loads(report.read_text())["cost"]
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(result))
    return result
