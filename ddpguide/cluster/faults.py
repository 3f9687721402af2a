"""Faults that need real nodes: a link that goes dead under a running job.

* :func:`dead_link`: ``dead_link.py`` all-reduces in a loop; a node's link goes down.
* :func:`lose_node_by_link`: chapter 4's ``elastic_train.py`` under torchrun's c10d
  rendezvous on every node; a node's link goes down, and the others go on without it.

Both take the link down from inside the runner's own loop (its ``until`` hook), at
the moment the run's progress says, and bring it back up before they return.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.cluster.experiments import CLUSTER_PROGRAMS
from ddpguide.cluster.launch import torchrun_on
from ddpguide.core import scratch
from ddpguide.elastic.program import LOG, PROGRAM, agent_settings, program_folder, read_log

#: the c10d rendezvous port, on node 0 (inside the cluster's own namespaces)
ELASTIC_PORT = 29400


def dead_link(cluster: Cluster, *, node: int = 1, after_steps: int = 3, pg_timeout: float = 10.0,
              timeout: float = 300.0) -> dict:
    """Run ``dead_link.py`` on one rank per node; take ``node``'s link down after
    ``after_steps`` steps. Returns, per node, its exit status and the line the program
    printed about the error, and the seconds from the link going down to the last exit."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-dead-link-") as folder:
        progress = Path(folder, "progress")
        pulled: list[float] = []

        def pull(codes: list[int | None]) -> bool:
            text = progress.read_text() if not pulled and progress.exists() else ""
            if text.isdigit() and int(text) >= after_steps:
                cluster.set_link(cluster.node(node), up=False)
                pulled.append(time.monotonic())
            return False
        try:
            ended = torchrun_on(cluster, [str(CLUSTER_PROGRAMS / "dead_link.py"), "--timeout",
                                          str(pg_timeout), "--progress", str(progress)],
                                timeout, cwd=folder, until=pull)
        finally:
            cluster.set_link(cluster.node(node), up=True)
        finished = time.monotonic()
    lines = [next((m.group(0) for m in re.finditer(r"rank \d+: all_reduce raised .*", e.stdout)),
                  "") for e in ended]
    return {"returncodes": [e.returncode for e in ended], "errors": lines,
            "seconds_after_pull": finished - pulled[0] if pulled else None}


def elastic_commands(cluster: Cluster, *, epochs: int, epoch_seconds: float,
                     pg_timeout: float) -> tuple[list[str], dict[str, str]]:
    """The command every node types (after ``ip netns exec``) and its environment: chapter 4's
    tuned agent, ``--nnodes=N-1:N``, the rendezvous at ``node0``, whose agent hosts the store."""
    n = len(cluster.nodes)
    settings = agent_settings(ELASTIC_PORT, cluster.spec.ranks_per_node, nnodes=f"{n - 1}:{n}",
                              host=cluster.nodes[0].name)
    settings.rdzv_id = f"cluster-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "torch.distributed.run", *settings.torchrun_args(), PROGRAM,
            "--epochs", str(epochs), "--epoch-seconds", f"{epoch_seconds:g}", "--epoch-log", LOG,
            "--timeout", f"{pg_timeout:g}"]
    return argv, settings.environment()


def lose_node_by_link(cluster: Cluster, *, node: int | None = None, after_epoch: int = 2,
                      epochs: int = 12, epoch_seconds: float = 0.5, pg_timeout: float = 10.0,
                      timeout: float = 300.0) -> dict:
    """Train ``elastic_train.py`` on every node; after epoch ``after_epoch`` is logged, take
    ``node``'s link down (default: the last node). The run ends when every other node's
    torchrun has ended; the lost node's agent, which reaches nobody, is stopped then.

    Returns the timeline (seconds from the start: each epoch as the log showed it, with its
    world size and restart count; the link going down), every node's exit status (None:
    stopped), the survivors' first error line, the epoch log and the commands run.
    """
    lost = len(cluster.nodes) - 1 if node is None else node
    if lost == 0:
        raise ValueError("node 0 hosts the rendezvous store: losing it ends the job; lose another")
    folder = program_folder()
    argv, env = elastic_commands(cluster, epochs=epochs, epoch_seconds=epoch_seconds,
                                 pg_timeout=pg_timeout)
    began = time.monotonic()
    timeline: list[dict] = []
    survivors = [k for k in range(len(cluster.nodes)) if k != lost]

    def watch(codes: list[int | None]) -> bool:
        now = round(time.monotonic() - began, 2)
        records = read_log(folder / LOG)
        seen = sum(1 for event in timeline if event["event"] == "epoch")
        timeline.extend({"t": now, "event": "epoch", **record} for record in records[seen:])
        if not any(e["event"] == "link down" for e in timeline) and any(
                r["epoch"] >= after_epoch for r in records):
            cluster.set_link(cluster.nodes[lost], up=False)
            timeline.append({"t": now, "event": "link down", "node": lost})
        return all(codes[k] is not None for k in survivors)
    try:
        ended = cluster.run([(n, argv) for n in cluster.nodes], timeout, extra_env=env,
                            cwd=folder, fail_fast=False, until=watch)
        watch([e.returncode for e in ended])  # the epochs logged since the last turn
        records = read_log(folder / LOG)
    finally:
        cluster.set_link(cluster.nodes[lost], up=True)
        scratch.remove(folder)
    errors = [next((line.strip() for line in (e.stdout + e.stderr).splitlines()
                    if "Timed out waiting" in line or "Connection closed by peer" in line), "")
              for e in ended]
    return {"lost": lost, "returncodes": [e.returncode for e in ended], "timeline": timeline,
            "records": records, "errors": errors, "pg_timeout": pg_timeout, "epochs": epochs,
            "command": " ".join([*(f"{k}={v}" for k, v in env.items()), "torchrun", *argv[3:]])}
