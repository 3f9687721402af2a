"""Losing the node that hosts the rendezvous store, with and without a separate store.

By default the first agent hosts the c10d store in its own process. Lose
that machine and the other agents lose the rendezvous with it: the job ends
(pytorch#67742), however many restarts are left. With the store in a process
of its own (``python -m ddpguide.elastic store``), any node may go.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ddpguide.elastic.cluster import LocalCluster


def _first(events: list[dict], event: str, after: float, world_size: int | None = None):
    for e in events:
        if (e["event"] == event and e["t"] > after and e.get("rank") == 0
                and (world_size is None or e["world_size"] == world_size)):
            return e
    return None


def _last_error_line(log: Path) -> str:
    """The most telling line of a failed agent's log (its final exception)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line and not line.startswith("File "):
            return line[:240]
    return lines[-1][:240] if lines else ""


def lose_store_host(external_store: bool, epochs: int = 6, step_delay: float = 0.1,
                    timeout_s: float = 60.0) -> dict:
    """Start A (which would host the store) and B, kill A after an epoch; what becomes of B?

    Returns ``survived`` (B trained to the end), ``b_exit_code``, ``b_error``
    (its last error line when it failed), ``recovery_s`` (kill to B's first
    step alone), ``epochs`` (the world size of every finished epoch) and
    ``worker_pids`` (every worker that ran).
    """
    workdir = Path(tempfile.mkdtemp(prefix="ddpguide-failover-"))
    try:
        with LocalCluster(workdir, epochs=epochs, step_delay=step_delay, nnodes="1:2") as cluster:
            if external_store:
                cluster.start_store()
            # B's agent starts at once and waits for its cue, so its Python
            # start-up overlaps A's: B joins while A is still in its first
            # epochs, however slowly the machine starts processes.
            node_b = cluster.start_node("B", 2, on_cue=True)
            cluster.start_node("A", 2)
            cluster.wait_for_store(timeout_s)
            if not cluster.wait(lambda: bool(_first(cluster.all_events, "epoch", 0.0, 2) and any(
                    e["event"] == "agent_waiting" and e["node"] == "B" for e in cluster.all_events)),
                    timeout_s):
                raise TimeoutError("node A never finished an epoch, or node B's agent never "
                                   "came up")
            cluster.join("B")
            if not cluster.wait(lambda: bool(_first(cluster.all_events, "epoch", 0.0, 4)), timeout_s):
                raise TimeoutError("the two nodes never finished an epoch together")
            killed = cluster.kill_node("A")
            cluster.wait(lambda: not node_b.alive, timeout_s)
            cluster.poll()
            step = _first(cluster.all_events, "first_step", killed, 2)
            code = node_b.process.returncode
            finished = _first(cluster.all_events, "finished", killed) is not None
            from ddpguide.core.checkpoint import load_checkpoint

            state = load_checkpoint(cluster.checkpoint)
            history = state.get("history", []) if state else []
            return {
                "external_store": external_store,
                "survived": code == 0 and finished,
                "b_exit_code": code,
                "b_error": "" if code == 0 else _last_error_line(node_b.log),
                "recovery_s": round(step["t"] - killed, 3) if step else None,
                "epochs": [(h["epoch"], h["world_size"]) for h in history],
                "worker_pids": [e["pid"] for e in cluster.all_events if e["event"] == "spawned"],
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
