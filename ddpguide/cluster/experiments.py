"""The chapter's cluster programs run on a cluster, their results read back.

Each function starts the program on the cluster given with
:func:`ddpguide.cluster.launch.torchrun_on`, in a folder of its own, and returns rank
0's ``--out`` JSON; :func:`doctor` runs ``python -m ddpguide.doctor`` the same way.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.cluster.launch import torchrun_argv, torchrun_on
from ddpguide.core.commands import one_line

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs"
CLUSTER_PROGRAMS = PROGRAMS / "cluster"


class ProgramFailed(RuntimeError):
    """A program on the cluster ended badly: the message has the end of its output."""


def run_program(cluster: Cluster, program: str | Path, args: list[str], timeout: float) -> object:
    """Run ``program`` (a path) with ``args`` on every node; rank 0's JSON output."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-cluster-run-") as folder:
        out = Path(folder, "result.json")
        ended = torchrun_on(cluster, [str(program), *args, "--out", str(out)], timeout, cwd=folder)
        if any(e.returncode != 0 for e in ended) or not out.exists():
            tails = [f"node{k}: exit {e.returncode}: {one_line(e.stderr[-600:] or e.stdout[-600:])}"
                     for k, e in enumerate(ended) if e.returncode != 0] or ["no result written"]
            raise ProgramFailed(f"{Path(program).name} on the cluster: " + "; ".join(tails))
        return json.loads(out.read_text())


def collectives(cluster: Cluster, *, numel: int = 2**21, sizes: tuple[int, ...] = (
        2**20, 2**21, 2**22, 2**23), repeats: int = 3, timeout: float = 400) -> dict:
    result = run_program(cluster, CLUSTER_PROGRAMS / "collectives.py",
                         ["--numel", str(numel), "--sizes", ",".join(map(str, sizes)),
                          "--repeats", str(repeats)], timeout)
    assert isinstance(result, dict)
    return result


def sharding(cluster: Cluster, layout: str, *, layers: int = 4, width: int = 512,
             timeout: float = 400) -> dict:
    result = run_program(cluster, CLUSTER_PROGRAMS / "sharding.py",
                         ["--layout", layout, "--layers", str(layers), "--width", str(width)],
                         timeout)
    assert isinstance(result, dict)
    return result


def ddp_overlap(cluster: Cluster, *, bucket_mb: tuple[float, ...] = (0.0625, 25.0),
                layer_ms: float = 15.0, steps: int = 5, timeout: float = 500) -> list[dict]:
    result = run_program(cluster, CLUSTER_PROGRAMS / "ddp_overlap.py",
                         ["--bucket-mb", ",".join(map(str, bucket_mb)), "--layer-ms",
                          str(layer_ms), "--steps", str(steps)], timeout)
    assert isinstance(result, list)
    return result


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
    lines = ended[0].stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ddpguide doctor:")), len(lines))
    command = ["torchrun", *torchrun_argv(cluster, 0, program[:6])[3:]]
    command[command.index("--node-rank") + 1] = "K"
    return {"returncodes": [e.returncode for e in ended], "report": report,
            "lines": lines[start:], "command": " ".join(command)}
