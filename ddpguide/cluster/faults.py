"""Faults that need real nodes: a link that goes dead under a running job.

:func:`dead_link` runs ``dead_link.py``, which all-reduces in a loop, on one rank per node,
and takes a node's link down from inside the runner's own loop (its ``until`` hook), at
the moment the run's progress says; it brings the link back up before it returns.
(Chapter 4's elastic run that loses a node by its link is
:func:`ddpguide.bench.cluster_elastic.lose_node_by_link`.)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.cluster.launch import torchrun_on
from ddpguide.launch import report as reports
from ddpguide.launch.programs import path_of

PROGRAM = "cluster/dead_link.py"


def dead_link(cluster: Cluster, *, node: int = 1, after_steps: int = 3, pg_timeout: float = 10.0,
              timeout: float = 300.0) -> dict:
    """Run ``dead_link.py`` on one rank per node, each node in a folder of its own; take
    ``node``'s link down after ``after_steps`` steps; every node ends on its own error (one
    node's exit stops no other: each one's wait is the measurement). Returns each node's exit status and
    report (its steps, the error it raised and how long after its last good step), and the
    seconds from the link going down to the last exit."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-dead-link-") as folder:
        progress = Path(folder, "progress")
        disks = [Path(folder, n.name) for n in cluster.nodes]
        for disk in disks:
            disk.mkdir()
        pulled: list[float] = []

        def pull(codes: list[int | None]) -> bool:
            text = progress.read_text() if not pulled and progress.exists() else ""
            if text.isdigit() and int(text) >= after_steps:
                cluster.set_link(cluster.node(node), up=False)
                pulled.append(time.monotonic())
            return False
        try:
            ended = torchrun_on(cluster, [str(path_of(PROGRAM)), "--timeout", str(pg_timeout),
                                          "--progress", str(progress), "--report", "report.json"],
                                timeout, cwd=disks, until=pull, fail_fast=False)
        finally:
            cluster.set_link(cluster.node(node), up=True)
        finished = time.monotonic()
        found = [reports.read(disk / "report.json", f"{PROGRAM} on {n.name}")
                 for disk, n in zip(disks, cluster.nodes, strict=True)]
    return {"returncodes": [e.returncode for e in ended], "reports": found,
            "errors": [r["error"] or "" for r in found],
            "seconds_after_pull": finished - pulled[0] if pulled else None}
