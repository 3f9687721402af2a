"""The timeline of an elastic run: printed live, then summarised as a JSON-able report.

Which epochs finished is read from the final checkpoint, which carries the
history of every epoch that was saved (an epoch interrupted by a restart is
not in it; a saved epoch is never run again): the one file of ``ddp``, or the
``extra`` of the DCP directory of ``fsdp``. The event file adds times, and with
``fsdp`` the world size that saved the checkpoint each group resumed from.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ddpguide.elastic.worker_args import STRATEGIES, WorkerArgs


@dataclass
class RunLog:
    """What happened and when, relative to the first action; prints as it goes."""

    echo: Callable[[str], None] | None = print
    #: Called with every line of the event file as it arrives (a progress bar).
    on_event: Callable[[dict[str, Any]], None] | None = None
    t0: float | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    worker_events: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    _pending: dict[str, Any] | None = None

    def _add(self, t: float, event: str, text: str, **fields: Any) -> None:
        if self.t0 is None:
            self.t0 = t
        entry = {"time_s": round(t - self.t0, 3), "event": event, "world_size": None,
                 "epoch": None, **fields, "text": text}
        self.entries.append(entry)
        if self.echo:
            self.echo(f"{entry['time_s']:6.1f} s  {text}")

    def action(self, text: str, t: float, world_size: int | None = None,
               expect: int | None = None, cause: str | None = None) -> None:
        """Something the orchestrator did; ``cause`` starts a recovery measurement."""
        self._add(t, cause or "action", text, world_size=world_size)
        if cause:
            self._pending = {"cause": cause, "t": t, "expect": expect}

    def worker_event(self, e: dict[str, Any]) -> None:
        """One line of the event file."""
        self.worker_events.append(e)
        if self.on_event:
            self.on_event(e)
        if e["event"] == "agent_waiting":
            self._add(e["t"], "agent_waiting", f"node {e['node']}'s agent is up, waiting for its cue",
                      node=e["node"])
            return
        if e.get("rank") != 0 or e["event"] in ("spawned", "ready"):
            return
        ws, t = e["world_size"], e["t"]
        if e["event"] == "start":
            how = f"resumes at epoch {e['epoch']}" if e["resumed"] else "starts at epoch 0"
            # Only sharded workers report who saved: their groups reshard what they load.
            saved_by = {"saved_by": e["saved_by"]} if e.get("saved_by") else {}
            if saved_by:
                how += f" from shards saved by {e['saved_by']} ranks"
            self._add(t, "group_start", f"worker group of {ws} {how} "
                      f"(node {e['node']}, restart count {e['restart']})",
                      world_size=ws, epoch=e["epoch"], restart=e["restart"], node=e["node"],
                      **saved_by)
        elif e["event"] == "first_step":
            text = f"first step at world size {ws}"
            pending = self._pending
            recovery = None
            if pending and t > pending["t"] and pending["expect"] in (None, ws):
                recovery = round(t - pending["t"], 3)
                self.recoveries.append({"cause": pending["cause"], "seconds": recovery,
                                        "world_size": ws, "epoch": e["epoch"],
                                        "time_s": round(t - self.t0, 3)})
                text += f": recovered from the {pending['cause']} in {recovery:.1f} s"
                self._pending = None
            self._add(t, "first_step", text, world_size=ws, epoch=e["epoch"],
                      recovery_s=recovery)
        elif e["event"] == "epoch":
            self._add(t, "epoch", f"epoch {e['epoch']} done at world size {ws} "
                      f"(loss {e['loss']:.3f}, {e['seconds']:.1f} s)",
                      world_size=ws, epoch=e["epoch"])
        elif e["event"] == "finished":
            self._add(t, "finished", "training finished", world_size=ws)


def _history(checkpoint, sharded: bool) -> list[dict[str, Any]]:
    if sharded:
        from ddpguide.sharding.dcp import find_checkpoint, read_extra

        return list(read_extra(checkpoint).get("history", [])) \
            if find_checkpoint(checkpoint) else []
    from ddpguide.core.checkpoint import load_checkpoint

    state = load_checkpoint(checkpoint)
    return list(state.get("history", [])) if state else []


#: in a node's log, once for each worker group whose rank 0 found its MASTER_PORT taken
PORT_TAKEN = "name: EADDRINUSE"


def failed_starts(cluster) -> dict[str, int]:
    """Per node, the worker groups that failed to start because MASTER_PORT was taken.

    With the store-sharing workaround, torch's agent picks each group's MASTER_PORT with
    ``get_free_port`` (torch/distributed/elastic/utils/distributed.py), which binds port 0 and
    closes the socket again: its docstring warns that another process may take the port
    before rank 0 listens on it. Rank 0 then fails, and the agent restarts the group,
    spending one of ``--max-restarts``."""
    return {name: node.log.read_text(errors="replace").count(PORT_TAKEN) if node.log.exists() else 0
            for name, node in cluster.nodes.items()}


def build_report(log: RunLog, cluster, settings) -> dict[str, Any]:
    """The JSON report: events, completed epochs in order, recoveries, world sizes."""
    strategy = getattr(settings, "strategy", WorkerArgs.strategy)
    history = _history(cluster.checkpoint, STRATEGIES[strategy].sharded)
    epoch_times: dict[int, float] = {}
    for entry in log.entries:
        if entry["event"] == "epoch":
            epoch_times.setdefault(entry["epoch"], entry["time_s"])
    epochs = [{"epoch": h["epoch"], "world_size": h["world_size"],
               "loss": h["train_loss"], "time_s": epoch_times.get(h["epoch"])}
              for h in history]
    reported = Counter(e["epoch"] for e in log.worker_events
                       if e["event"] == "epoch" and e.get("rank") == 0)
    groups = [e for e in log.entries if e["event"] == "group_start"]
    finished = any(e["event"] == "finished" for e in log.entries)
    return {
        "settings": {"epochs": settings.epochs, "step_delay_s": settings.step_delay,
                     "nnodes": settings.nnodes, "torchrun_defaults": settings.torchrun_defaults,
                     "external_store": settings.external_store, "strategy": strategy},
        "events": log.entries,
        "epochs": epochs,
        "epochs_reported_twice": sorted(k for k, n in reported.items() if n > 1),
        "groups": [{"time_s": g["time_s"], "world_size": g["world_size"],
                    "start_epoch": g["epoch"], "restart": g["restart"], "node": g["node"],
                    **({"saved_by": g["saved_by"]} if "saved_by" in g else {})}
                   for g in groups],
        "world_sizes": [g["world_size"] for g in groups],
        "failed_starts": failed_starts(cluster),
        "recoveries": log.recoveries,
        "finished": finished and len(epochs) == settings.epochs,
        "duration_s": log.entries[-1]["time_s"] if log.entries else 0.0,
    }


def summary(report: dict[str, Any]) -> str:
    """A few lines a reader can check at a glance."""
    sizes = " -> ".join(str(s) for s in report["world_sizes"])
    epochs = [e["epoch"] for e in report["epochs"]]
    once = epochs == list(range(len(epochs))) and not report["epochs_reported_twice"]
    per_size = Counter(e["world_size"] for e in report["epochs"])
    lines = [
        "summary",
        f"  worker groups: {len(report['world_sizes'])}, world sizes {sizes}",
        f"  epochs finished: {len(epochs)} of {report['settings']['epochs']}, "
        f"{'each exactly once' if once else 'NOT each exactly once'} "
        f"({', '.join(f'{n} at world size {s}' for s, n in sorted(per_size.items()))})",
    ]
    reshards = [f"{g['saved_by']} -> {g['world_size']} ranks" for g in report["groups"]
                if g.get("saved_by", g["world_size"]) != g["world_size"]]
    choice = STRATEGIES[report["settings"].get("strategy", WorkerArgs.strategy)]
    if choice.sharded:
        lines.append(f"  sharded checkpoint ({choice.title} + DCP), resharded on load: "
                     f"{', '.join(reshards) or 'never'}")
    for r in report["recoveries"]:
        lines.append(f"  {r['cause']:>5}: {r['seconds']:.1f} s to the first step at world "
                     f"size {r['world_size']} (resumed at epoch {r['epoch']})")
    failed = {name: n for name, n in report.get("failed_starts", {}).items() if n}
    if failed:
        lines.append("  failed starts (MASTER_PORT taken before rank 0 listened, one restart each): "
                     + ", ".join(f"node {name} {n}" for name, n in sorted(failed.items())))
    lines.append(f"  finished: {'yes' if report['finished'] else 'no'} "
                 f"after {report['duration_s']:.0f} s")
    return "\n".join(lines)
