"""The chapter's cluster programs run on a cluster, their reports read back.

Each function starts the program on the cluster given with
:func:`ddpguide.cluster.launch.torchrun_on`, in a folder of its own, and returns rank
0's report (``--report``, read with :func:`ddpguide.launch.report.read`); :func:`doctor`
runs ``python -m ddpguide.doctor`` the same way.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.cluster.launch import torchrun_argv, torchrun_on
from ddpguide.core.commands import one_line
from ddpguide.launch import report as reports
from ddpguide.launch.programs import ProgramFailed, path_of

__all__ = ["ProgramFailed", "collectives", "ddp_overlap", "doctor", "run_program", "sharding"]


def run_program(cluster: Cluster, program: Path, args: list[str], timeout: float) -> dict:
    """Run ``program`` (:func:`ddpguide.launch.programs.path_of`) with ``args`` and
    ``--report`` on every node; rank 0's report. :class:`ProgramFailed` (one line) if a node
    fails or writes no report."""
    name = program.name
    with tempfile.TemporaryDirectory(prefix="ddpguide-cluster-run-") as folder:
        out = Path(folder, "report.json")
        ended = torchrun_on(cluster, [str(program), *args, "--report", str(out)], timeout,
                            cwd=folder)
        failed = [f"node{k}: exit {e.returncode}: {one_line(e.errors[-600:] or e.output[-600:])}"
                  for k, e in enumerate(ended) if e.returncode != 0]
        if failed:
            raise ProgramFailed(f"{name} on the cluster: " + "; ".join(failed))
        try:
            return reports.read(out, f"{name} on the cluster")
        except reports.ReportError as error:
            raise ProgramFailed(str(error)) from None


def collectives(cluster: Cluster, *, numel: int = 2**21, sizes: tuple[int, ...] = (
        2**20, 2**21, 2**22, 2**23), repeats: int = 3, timeout: float = 400) -> dict:
    """``cluster/collectives.py``: the point-to-point sweep and the five collectives."""
    return run_program(cluster, path_of("cluster/collectives.py"),
                       ["--numel", str(numel), "--sizes", ",".join(map(str, sizes)),
                        "--repeats", str(repeats)], timeout)


def sharding(cluster: Cluster, layout: str, *, layers: int = 4, width: int = 512,
             timeout: float = 400) -> dict:
    """``cluster/sharding.py`` with ``--layout layout`` (fsdp or hsdp)."""
    return run_program(cluster, path_of("cluster/sharding.py"),
                       ["--layout", layout, "--layers", str(layers), "--width", str(width)], timeout)


def ddp_overlap(cluster: Cluster, *, bucket_mb: tuple[float, ...] = (0.0625, 25.0),
                layer_ms: float = 15.0, steps: int = 5, timeout: float = 500) -> list[dict]:
    """``cluster/ddp_overlap.py``: one run per bucket size (the report's ``runs``)."""
    return run_program(cluster, path_of("cluster/ddp_overlap.py"),
                       ["--bucket-mb", ",".join(map(str, bucket_mb)), "--layer-ms",
                        str(layer_ms), "--steps", str(steps)], timeout)["runs"]


def doctor(cluster: Cluster, *, sizes: str = "64K,256K", doctor_timeout: float = 30.0,
           timeout: float = 300.0) -> dict:
    """``python -m ddpguide.doctor`` under ``torchrun --nnodes N`` across the nodes.

    Returns each node's exit status (the doctor exits 1 when it finds a problem), rank 0's
    report as printed (node 0's output without torchrun's own lines) and as JSON.
    """
    with tempfile.TemporaryDirectory(prefix="ddpguide-cluster-doctor-") as folder:
        out = Path(folder, "doctor.json")
        program = ["-m", "ddpguide.doctor", "--sizes", sizes, "--timeout", f"{doctor_timeout:g}",
                   "--json", str(out)]
        ended = torchrun_on(cluster, program, timeout, cwd=folder, fail_fast=False)
        report = json.loads(out.read_text()) if out.exists() else None
    lines = ended[0].output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ddpguide doctor:")), len(lines))
    command = ["torchrun", *torchrun_argv(cluster, 0, program[:6])[3:]]
    command[command.index("--node-rank") + 1] = "K"
    return {"returncodes": [e.returncode for e in ended], "report": report,
            "lines": lines[start:], "command": " ".join(command)}
