"""Chapter 4's elastic run on chapter 15's cluster: a node lost by its link, the others go on.

:func:`lose_node_by_link` trains ``elastic_train.py`` under torchrun's c10d rendezvous on
every node, takes a node's link down from inside the runner's own loop (its ``until``
hook) once the epoch log says so, and brings it back up before it returns. What each
node's workers raised is read from their torchrun error files (each node its own
``--log-dir``), not from their output. It stands on
both ``elastic`` (the chapter's agent settings and program) and ``cluster`` (the nodes),
so it lives here, above both.
"""

from __future__ import annotations

import sys
import time
import uuid

from ddpguide.cluster.cluster import Cluster
from ddpguide.core import scratch
from ddpguide.elastic.program import LOG, PROGRAM, agent_settings, program_folder
from ddpguide.launch.rank_files import worker_errors
from ddpguide.launch.report import read_log

#: the c10d rendezvous port, on node 0 (inside the cluster's own namespaces)
ELASTIC_PORT = 29400
#: node k's torchrun ``--log-dir`` (its workers' error files), in the run's folder
LOG_DIR = "logs/node{k}"


def elastic_commands(cluster: Cluster, *, epochs: int, epoch_seconds: float,
                     pg_timeout: float) -> tuple[list[list[str]], dict[str, str], str]:
    """The command each node types (after ``ip netns exec``), node k's with ``--log-dir``
    :data:`LOG_DIR`; their environment; the line a reader types on node k (``<k>``): chapter
    4's tuned agent, ``--nnodes=N-1:N``, the rendezvous at ``node0``, whose agent hosts the
    store."""
    n = len(cluster.nodes)
    settings = agent_settings(ELASTIC_PORT, cluster.spec.ranks_per_node, nnodes=f"{n - 1}:{n}",
                              host=cluster.nodes[0].name)
    settings.rdzv_id = f"cluster-{uuid.uuid4().hex[:8]}"
    env = settings.environment()

    def torchrun(k: object) -> list[str]:
        return [f"--log-dir={LOG_DIR.format(k=k)}", *settings.torchrun_args(), PROGRAM,
                "--epochs", str(epochs), "--epoch-seconds", f"{epoch_seconds:g}", "--epoch-log", LOG,
                "--timeout", f"{pg_timeout:g}"]
    typed = " ".join([*(f"{key}={value}" for key, value in env.items()), "torchrun", *torchrun("<k>")])
    return [[sys.executable, "-m", "torch.distributed.run", *torchrun(k)] for k in range(n)], env, typed


def lose_node_by_link(cluster: Cluster, *, node: int | None = None, after_epoch: int = 2,
                      epochs: int = 12, epoch_seconds: float = 0.5, pg_timeout: float = 10.0,
                      timeout: float = 300.0) -> dict:
    """Train ``elastic_train.py`` on every node; after epoch ``after_epoch`` is logged, take
    ``node``'s link down (default: the last node). The run ends when every other node's
    torchrun has ended; the lost node's agent, which reaches nobody, is stopped then.

    Returns the timeline (seconds from the start: each epoch as the log showed it, with its
    world size and restart count; the link going down), every node's exit status (None:
    stopped), the first line of the first error each node's workers raised ("" for none:
    their error files), the epoch log and the command run (node k's, with ``<k>``).
    """
    lost = len(cluster.nodes) - 1 if node is None else node
    if lost == 0:
        raise ValueError("node 0 hosts the rendezvous store: losing it ends the job; lose another")
    folder = program_folder()
    argvs, env, typed = elastic_commands(cluster, epochs=epochs, epoch_seconds=epoch_seconds,
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
        ended = cluster.run(list(zip(cluster.nodes, argvs)), timeout, extra_env=env,
                            cwd=folder, fail_fast=False, until=watch)
        watch([e.returncode for e in ended])  # the epochs logged since the last turn
        records = read_log(folder / LOG)
        errors = [(worker_errors(folder / LOG_DIR.format(k=k)) or [""])[0] for k in range(len(ended))]
    finally:
        cluster.set_link(cluster.nodes[lost], up=True)
        scratch.remove(folder)
    return {"lost": lost, "returncodes": [e.returncode for e in ended], "timeline": timeline,
            "records": records, "errors": errors, "pg_timeout": pg_timeout, "epochs": epochs,
            "command": typed}
