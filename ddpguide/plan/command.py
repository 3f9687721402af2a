"""The command ``python -m ddpguide.plan`` prints, run as printed on chapter 15's emulated
cluster, and what it measured set against what the planner predicted for it.

:func:`printed` runs the planner on a cluster's measured hardware (a file: what
:func:`measure.cluster_hardware` measured) and returns the ``torchrun`` lines it printed and
the ranked row they run (:func:`render.chosen`, which the command's own printing uses).
:func:`on_nodes` puts each line on its node: its ``--node-rank``, its ``--nproc-per-node``
and the cluster's must agree, ``NODE0`` becomes node 0's address, and the measurement's own
options are added (``--steps``, ``--cost``, ``--report``: how many steps, the count and the
report, nothing of the layout or the model). :func:`run` starts them, each in a copy of
``gpt/`` of its node's own, and reads the ``cost`` record of the report through
:func:`ddpguide.launch.report.read`. :func:`compared` is the step and the memory predicted
over measured (:func:`measure.memory_ratios`: the parts ``train.py --cost`` counts).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ddpguide.core import scratch
from ddpguide.core.commands import InputError
from ddpguide.launch.programs import copy_program
from ddpguide.launch.report import ReportError
from ddpguide.plan import catalog, measure, render, search

#: the step and the memory, predicted over measured: the goals of ``bench.plan_command``
STEP_BAND, MEMORY_BAND = (0.8, 1.25), (0.9, 1.1)
ENDPOINT = "NODE0"


def printed(p: ModuleType, hardware_file: Path, gpus: int, gpus_per_node: int, shape: dict[str, int],
            seq: int, batch: int, dtype: str, timeout: float = 300.0) -> tuple[dict[str, Any], list[str]]:
    """``python -m ddpguide.plan --model gpt`` with ``shape`` on the hardware in ``hardware_file``
    (``--runnable``): the ``torchrun`` lines it printed, and the ranked row they run, ranked
    again here with the same inputs (:class:`RuntimeError` if the printed lines are not
    that row's)."""
    options = ["--model", "gpt", *(x for k, v in shape.items() for x in (f"--{k.replace('_', '-')}", str(v))),
               "--gpus", str(gpus), "--gpus-per-node", str(gpus_per_node), "--hardware", str(hardware_file),
               "--seq", str(seq), "--global-batch", str(batch), "--dtype", dtype, "--runnable", "--top", "1"]
    done = subprocess.run([sys.executable, "-m", "ddpguide.plan", *options], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"python -m ddpguide.plan {' '.join(options)}: exit {done.returncode}: "
                           f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("torchrun ")]
    model, pol = catalog.model(p, "gpt", **shape), catalog.policy(p, dtype)
    hw = _hardware(p, hardware_file, gpus_per_node)
    rows = search.rank(p, model, pol, hw, gpus, batch, seq, True, headroom=1.0)
    row, expected, _ = render.chosen(rows, gpus_per_node, model, seq, batch, dtype)
    if row is None or lines != expected:
        raise RuntimeError(f"python -m ddpguide.plan printed {len(lines)} torchrun lines, not the "
                           f"{len(expected)} of its best row that train.py runs")
    return row, lines


def _hardware(p: ModuleType, path: Path, gpus_per_node: int) -> Any:
    from ddpguide.plan import hardware

    hw = hardware.load(p, str(path))
    hw.gpus_per_node = gpus_per_node
    return hw


def on_nodes(cluster: Any, lines: list[str], report: Path, steps: int) -> list[tuple[Any, list[str]]]:
    """Each printed line as the argv its node runs: ``torchrun`` is this interpreter's
    (``python -m torch.distributed.run``, as :func:`ddpguide.launch.programs.run` types it),
    ``NODE0`` node 0's address, and ``--steps``, ``--cost`` and ``--report`` added at the end.
    :class:`InputError` (one line) when the lines do not fit the cluster's nodes."""
    nodes, per_node = cluster.nodes, cluster.spec.ranks_per_node
    if len(lines) != len(nodes):
        raise InputError(f"{len(lines)} torchrun lines for a cluster of {len(nodes)} nodes")
    out = []
    for k, (node, line) in enumerate(zip(nodes, lines)):
        words = shlex.split(line.replace(f"{ENDPOINT}:", f"{nodes[0].address}:"))
        if words[0] != "torchrun" or _value(words, "--node-rank") != str(k) or \
                _value(words, "--nproc-per-node") != str(per_node):
            raise InputError(f"line {k + 1} is not torchrun --node-rank {k} --nproc-per-node {per_node}: {line}")
        if ENDPOINT in " ".join(words):
            raise InputError(f"line {k + 1} names {ENDPOINT} other than as the rendezvous host: {line}")
        out.append((node, [sys.executable, "-m", "torch.distributed.run", *words[1:], "--steps", str(steps),
                           "--cost", "--report", str(report)]))
    return out


def _value(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def run(cluster: Any, lines: list[str], steps: int = 20, timeout: float = 600.0,
        folder: Path | None = None) -> dict[str, Any]:
    """The printed lines started on the cluster's nodes at once, each in its node's own copy of
    ``gpt/`` (``train.py`` is named as printed, in the folder it runs in); the ``cost`` record
    of rank 0's report. ``steps``: ``--steps`` (train.py's default 20; the counted step is the
    second, the step time the median after it)."""
    folder = Path(folder or scratch.folder("ddpguide-plan-command-"))
    report = folder / "report.json"
    work = on_nodes(cluster, lines, report, steps)
    cwd = [copy_program("gpt/train.py", folder / node.name).parent for node, _ in work]
    ended = cluster.run(work, timeout, cwd=cwd)
    what = f"the printed command on {len(work)} nodes"
    if any(e.returncode != 0 for e in ended):
        raise ReportError(f"{what}: " + "; ".join(
            f"node{k}: exit {e.returncode}: {(e.errors.strip().splitlines() or [''])[-1]}"
            for k, e in enumerate(ended) if e.returncode != 0))
    return measure.cost_in(report, what)


def compared(p: ModuleType, row: dict[str, Any], shape: dict[str, int], seq: int, batch: int, dtype: str,
             cost: dict[str, Any]) -> dict[str, float]:
    """The row's predicted step over the measured median step, and the counted parts of memory
    (parameters, gradients, AdamW state, saved activations) predicted over counted at the busiest
    rank (all ranks under EP: :func:`measure.memory_ratios`), with the figures."""
    model, pol = catalog.model(p, "gpt", **shape), catalog.policy(p, dtype)
    memory = measure.memory_ratios(p, row["layout"], model, pol, seq, batch, cost)
    return {"step": row["step"]["total"] / cost["step_seconds"], "memory": memory["check"],
            "step_predicted_s": row["step"]["total"], "step_measured_s": cost["step_seconds"],
            "memory_predicted": memory["predicted"], "memory_measured": memory["measured"]}


def outside(ratios: dict[str, float]) -> list[str]:
    """What falls outside its band (:data:`STEP_BAND`, :data:`MEMORY_BAND`), one phrase each."""
    out = []
    for key, (low, high) in (("step", STEP_BAND), ("memory", MEMORY_BAND)):
        if not low <= ratios[key] <= high:
            out.append(f"{key} predicted / measured {ratios[key]:.3f} outside {low}-{high}")
    return out


def write_hardware(hw: Any, path: Path) -> Path:
    """``hw`` as the file ``--hardware FILE`` reads."""
    path.write_text(json.dumps(vars(hw)))
    return path
