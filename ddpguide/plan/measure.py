"""What the planner's checks measure: the emulated cluster's hardware (microbenchmarks only)
and the capstone's ``train.py`` on a layout (its own counting of memory, its step).

:func:`cluster_hardware` runs ``plan_measure.py --measure`` on the host and ``plan_measure.py
--sweep`` across chapter 15's emulated nodes (this machine alone: :func:`hardware.measured`).
:func:`run_layout` runs ``gpt/train.py --cost`` on a layout (its options:
:func:`render.options`) and returns its ``cost`` record (:func:`run_on_cluster`: the same
under ``torchrun --nnodes`` on the cluster's nodes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from ddpguide.core import scratch
from ddpguide.gpt import cost as gpt_cost
from ddpguide.gpt.layouts import PROGRAM as TRAIN
from ddpguide.launch import report as reports
from ddpguide.launch.programs import path_of
from ddpguide.launch.report import ReportError
from ddpguide.plan import hardware, render, search

MEMORY = ("parameters", "gradients", "optimizer", "activations")


def _cached(cache: str | None, key: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s record, kept in the folder ``cache`` under ``key``'s hash and read back from
    there by a later call with the same key (None: no folder, run every time)."""
    if cache is None:
        return run()
    saved = Path(cache) / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    result = run()
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result))
    return result


def fingerprint(hw: Any) -> str:
    """A short hash of every field of a ``plan_cost.Hardware``: the table a time run was
    measured beside, part of the key a cached run is kept under, so that it is read back only
    with that table."""
    fields = json.dumps(dataclasses.asdict(hw), sort_keys=True, default=str)
    return hashlib.sha256(fields.encode()).hexdigest()[:16]


def _extra(layout: Any, model: Any, seq: int, batch: int, dtype: str, steps: int,
           rate_window: float = 0.0) -> tuple[str, ...]:
    return (*render.model_options(model, seq, batch // layout.accumulate, dtype), "--steps", str(steps),
            "--clip", "1.0", *(("--rate-window", f"{rate_window:g}") if rate_window else ()))


def run_layout(layout: Any, model: Any, seq: int, batch: int, dtype: str, steps: int = 3,
               timeout: float = 600.0, cache: str | None = None, rate_window: float = 0.0) -> dict[str, Any]:
    """``train.py --cost`` on the layout: the record of its ``cost:`` line (memory counted by
    every rank, the median step). ``cache``: a folder where each finished run is kept and
    from which the same run is read back instead of run again. The memory counted is what the
    allocator's settings do not change: the ranks run with one thread and no ``MALLOC_*``
    tunable, so that the package tests may fork them warm (:mod:`ddpguide.launch.warm`). The
    loopback time check reads its step too (:func:`run_beside`): one thread a rank, as the
    matmul table is timed. ``rate_window``: train.py's ``--rate-window`` (0: none), the rate
    all ranks get together, timed before each step (:mod:`ddpguide.plan.calibrate`)."""
    extra = _extra(layout, model, seq, batch, dtype, steps, rate_window)
    options = render.options(layout)
    return _cached(cache, " ".join((*options, *extra)), lambda: gpt_cost.measure(
        options, layout.world, extra=extra, timeout=timeout, env={"OMP_NUM_THREADS": "1"})[0])


def run_beside(p: ModuleType, layout: Any, model: Any, seq: int, batch: int, dtype: str, steps: int = 5,
               cache: str | None = None, rate_window: float = 0.0) -> tuple[Any, dict[str, Any]]:
    """This machine's hardware measured (:func:`hardware.measured`: the matmul table, the
    cores the layout's ranks get, the loopback link under ``torchrun`` of as many ranks), then
    at once :func:`run_layout` on the layout: the hardware and the run's record, measured side
    by side. ``cache`` keeps the two together, so a run read back comes with the table that
    was measured beside it, never with one measured at another time. ``rate_window`` as in
    :func:`run_layout`. The record gains
    ``beside_seconds``: how long the table, then the run, took (wall clock), and ``measured_at``
    (UTC) when the table was started."""
    def both() -> dict[str, Any]:
        at, start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.monotonic()
        hw = hardware.measured(p, ranks=layout.world)
        probed = time.monotonic()
        result = run_layout(layout, model, seq, batch, dtype, steps=steps, rate_window=rate_window)
        return {"hardware": dataclasses.asdict(hw), "result": {
            **result, "measured_at": at, "beside_seconds": [probed - start, time.monotonic() - probed]}}
    key = " ".join(("beside", *render.options(layout), *_extra(layout, model, seq, batch, dtype, steps, rate_window)))
    found = _cached(cache, key, both)
    return hardware.from_fields(p, found["hardware"], "a cached table", known_only=True), found["result"]


def counted(memory: dict[str, int]) -> int:
    """The parts of a rank's memory ``train.py --cost`` counts (the planner predicts more:
    FSDP's unsharded buffers and communication buffers, which the program does not count)."""
    return sum(memory[k] for k in MEMORY)


def memory_ratios(p: ModuleType, layout: Any, model: Any, policy: Any, seq: int, batch: int,
                  result: dict[str, Any]) -> dict[str, float]:
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


def cluster_hardware(p: ModuleType, cluster: Any, folder: Path | None = None, seconds: float | None = None,
                     repeats: int | None = None) -> Any:
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
    hardware.checked(search.run_step("--measure", str(path), "--ranks", str(ranks), *timing, echo=False, timeout=300,
                                     workdir=folder / "measure", program=search.MEASURE, report=True))
    # the book's own file: its folder, with plan_cost.py, is the script's first import path
    swept = folder / "sweep.json"
    ended = torchrun_on(cluster, [str(path_of(search.MEASURE)), "--sweep", str(path), *sizes, "--report", str(swept)],
                        300, cwd=folder)
    failed = [(e.errors.strip().splitlines() or [f"exit {e.returncode}"])[-1] for e in ended if e.returncode != 0]
    if failed:
        raise RuntimeError(f"{search.MEASURE} --sweep on the cluster: " + " | ".join(failed))
    sweep = reports.read(swept, f"{search.MEASURE} --sweep on the cluster")
    if reports.failed(sweep):
        raise ReportError(f"{search.MEASURE} --sweep on the cluster: failed checks: {', '.join(reports.failed(sweep))}")
    hw = hardware.from_file(p, path)
    hw.name = f"cluster {cluster.spec.nodes} x {cluster.spec.ranks_per_node}, {cluster.spec.link}"
    hw.nics, hw.overlap = 1, True  # one link a node, shared by its ranks; DDP's all-reduce waits on it
    hw.gpus_per_node = cluster.spec.ranks_per_node
    return hw


def cost_in(path: Path, what: str) -> dict[str, Any]:
    """The ``cost`` record of the report ``train.py --cost --report`` wrote at ``path``, read
    through :func:`ddpguide.launch.report.read`: :class:`ReportError` (one line) for a report
    that breaks the contract, one with a failed check, or one without a ``cost``."""
    found = reports.read(path, what)
    if reports.failed(found):
        raise ReportError(f"{what}: failed checks in {path}: {', '.join(reports.failed(found))}")
    if not isinstance(found.get("cost"), dict):
        raise ReportError(f"{what}: the report {path} holds no cost (was --cost given?)")
    return found["cost"]


def run_on_cluster(cluster: Any, layout: Any, model: Any, seq: int, batch: int, dtype: str, steps: int = 5,
                   timeout: float = 900.0, cache: str | None = None, beside: str = "") -> dict[str, Any]:
    """``train.py --cost`` on the layout across the cluster's nodes (one ``torchrun --nnodes`` a
    node, as chapter 15 starts programs): the ``cost`` record of its report. ``cache`` as in
    :func:`run_layout` (the link rate and ``beside``, the table's :func:`fingerprint`, are
    part of the key)."""
    from ddpguide.cluster.launch import torchrun_on

    extra = _extra(layout, model, seq, batch, dtype, steps)
    options = render.options(layout)

    def once() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ddpguide-plan-run-") as folder:
            report = Path(folder, "report.json")
            program = [str(path_of(TRAIN)), *options, *extra, "--cost", "--report", str(report)]
            ended = torchrun_on(cluster, program, timeout, cwd=folder)
            what = f"{TRAIN} {' '.join(options)} on the cluster"
            if any(e.returncode != 0 for e in ended):
                tails = [f"node{k}: exit {e.returncode}: {(e.errors.strip().splitlines() or [''])[-1]}"
                         for k, e in enumerate(ended) if e.returncode != 0]
                raise ReportError(f"{what}: " + "; ".join(tails))
            return cost_in(report, what)
    key = ("cluster", *options, *extra, cluster.spec.link, str(cluster.spec.nodes),
           *(["beside", beside] if beside else []))
    return _cached(cache, " ".join(key), once)
