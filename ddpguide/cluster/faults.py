"""Faults that need real nodes: a link that goes dead under a running collective."""

from __future__ import annotations

import re
import tempfile
import threading
import time
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.cluster.experiments import CLUSTER_PROGRAMS
from ddpguide.cluster.launch import torchrun_on


def dead_link(cluster: Cluster, *, node: int = 1, after_steps: int = 3, pg_timeout: float = 10.0,
              timeout: float = 300.0) -> dict:
    """Run ``dead_link.py`` on one rank per node; take ``node``'s link down after
    ``after_steps`` steps. Returns, per node, its exit status and the line the program
    printed about the error, and the seconds from the link going down to the last exit."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-dead-link-") as folder:
        progress = Path(folder, "progress")
        pulled: list[float] = []

        def pull() -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                text = progress.read_text() if progress.exists() else ""
                if text.isdigit() and int(text) >= after_steps:
                    cluster.set_link(cluster.node(node), up=False)
                    pulled.append(time.monotonic())
                    return
                time.sleep(0.05)
        puller = threading.Thread(target=pull, daemon=True)
        puller.start()
        ended = torchrun_on(cluster, [str(CLUSTER_PROGRAMS / "dead_link.py"), "--timeout",
                                      str(pg_timeout), "--progress", str(progress)],
                            timeout, cwd=folder)
        finished = time.monotonic()
        puller.join(timeout=1)
        cluster.set_link(cluster.node(node), up=True)
    lines = [next((m.group(0) for m in re.finditer(r"rank \d+: all_reduce raised .*", e.stdout)),
                  "") for e in ended]
    return {"returncodes": [e.returncode for e in ended], "errors": lines,
            "seconds_after_pull": finished - pulled[0] if pulled else None}
