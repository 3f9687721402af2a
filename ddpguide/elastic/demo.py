"""The local demo: a node joins, a node leaves, a worker crashes; training finishes anyway.

Node A starts alone with 2 workers. After a few epochs node B joins (world
size 4, training resumes from the checkpoint); later B leaves (back to 2);
later one of A's workers is killed with SIGKILL and torchrun restarts the
group. With ``strategy="fsdp"`` the workers shard the model with FSDP2 and
every new group reshards the checkpoint the previous one saved. Every step is
driven by what the workers report, not by a clock, so a slow machine gives the
same story, only slower.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddpguide.elastic.cluster import LocalCluster
from ddpguide.elastic.report import RunLog, build_report
from ddpguide.elastic.worker_args import WorkerArgs

# How many finished epochs each phase lasts before the next disturbance.
EPOCHS_BEFORE_JOIN = 2
EPOCHS_AT_FOUR = 3
EPOCHS_BEFORE_CRASH = 2
# The fewest epochs the demo takes: the three phases, the epochs the first group may
# still finish while node B's workers start (it trains on until its agent restarts it:
# one in a saved run, with room for two), and the epoch the crash interrupts.
MIN_EPOCHS = EPOCHS_BEFORE_JOIN + EPOCHS_AT_FOUR + EPOCHS_BEFORE_CRASH + 2 + 1
# The longest phase runs 16 steps at world size 2 (2 epochs of 256 samples in
# batches of 16 per worker) within its 60 s limit: 1 s a step leaves room for
# a slow machine's restarts.
MAX_STEP_DELAY_S = 1.0


class DemoError(RuntimeError):
    """The demo did not reach its next milestone in time (the node logs say why)."""


@dataclass
class DemoSettings:
    """Sizes and pacing of the demo (the defaults fit in about a minute on 2 cores)."""

    epochs: int = 14
    step_delay: float = 0.15
    nnodes: str = "1:2"
    phase_timeout_s: float = 60.0
    external_store: bool = False
    torchrun_defaults: bool = False
    strategy: str = WorkerArgs.strategy  # or fsdp: FSDP2 workers and a sharded (DCP) checkpoint


def run_demo(workdir: str | Path | None = None, settings: DemoSettings | None = None,
             report_path: str | Path | None = None,
             echo: Callable[[str], None] | None = print,
             on_event: Callable[[dict], None] | None = None) -> dict:
    """Run the scenario; return (and optionally write) the report of :func:`build_report`.

    ``echo`` gets each timeline line as it happens, ``on_event`` each worker event.
    """
    settings = settings or DemoSettings()
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="ddpguide-elastic-")) if workdir is None else Path(workdir)
    log = RunLog(echo=echo, on_event=on_event)
    cluster = LocalCluster(workdir, epochs=settings.epochs, step_delay=settings.step_delay,
                           nnodes=settings.nnodes, torchrun_defaults=settings.torchrun_defaults,
                           strategy=settings.strategy)
    try:
        with cluster:
            if settings.external_store:
                cluster.start_store()
            _scenario(cluster, log, settings)
        report = build_report(log, cluster, settings)
    except (RuntimeError, TimeoutError) as exc:  # DemoError, or a process that never came up
        # Keep the node logs of a failed run: they hold the explanation.
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise DemoError(f"{first} (node logs kept in {workdir})") from None
    if own_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    if report_path:
        Path(report_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _wait_for(cluster: LocalCluster, log: RunLog, done: Callable[[], bool], what: str,
              timeout_s: float, exit_expected: bool = False) -> None:
    """Feed new events to the log until ``done()``; raise DemoError after ``timeout_s``."""
    def ready() -> bool:
        for event in cluster.all_events[seen[0]:]:
            log.worker_event(event)
        seen[0] = len(cluster.all_events)
        if done():
            return True
        for name, node in cluster.nodes.items():
            if node.stopped is None and not node.alive and not exit_expected:
                raise DemoError(f"node {name} exited with code {node.process.returncode} while "
                                f"waiting for {what}; its log ends:\n{cluster.log_tail(name)}")
        return False

    seen = [len(cluster.all_events)]
    if not cluster.wait(ready, timeout_s):
        tails = "\n".join(f"--- node {n} ---\n{cluster.log_tail(n)}" for n in cluster.nodes)
        raise DemoError(f"no {what} within {timeout_s:g} s\n{tails}")


def _epochs_at(log: RunLog, world_size: int, since: float) -> int:
    return sum(1 for e in log.worker_events
               if e["event"] == "epoch" and e["world_size"] == world_size and e["t"] > since)


def _agent_waiting(log: RunLog, name: str) -> bool:
    return any(e["event"] == "agent_waiting" and e["node"] == name for e in log.worker_events)


def check_crash_lands(log: RunLog, epochs: int) -> None:
    """Raise DemoError if the last epoch is done: a group restarted after a kill now would
    have nothing left to train, and the report would show no recovery from the crash."""
    if any(e["event"] == "finished" or (e["event"] == "epoch" and e["epoch"] >= epochs - 1)
           for e in log.worker_events if e.get("rank") == 0):
        raise DemoError(f"training finished its {epochs} epochs before the crash: give it more --epochs")


def _scenario(cluster: LocalCluster, log: RunLog, settings: DemoSettings) -> None:
    timeout = settings.phase_timeout_s
    # B's agent starts first and waits for its cue, so its Python start-up
    # overlaps A's and the join below measures only the elastic machinery.
    cluster.start_node("B", 2, on_cue=True)
    node_a = cluster.start_node("A", 2)
    log.action("node A starts with 2 workers", node_a.started, world_size=2)
    _wait_for(cluster, log, lambda: _epochs_at(log, 2, node_a.started) >= EPOCHS_BEFORE_JOIN
              and _agent_waiting(log, "B"),
              f"{EPOCHS_BEFORE_JOIN} epochs at world size 2", timeout + 30)

    joined = cluster.join("B")
    log.action("node B joins with 2 workers", joined, expect=4, cause="join")
    _wait_for(cluster, log, lambda: _epochs_at(log, 4, joined) >= EPOCHS_AT_FOUR,
              f"{EPOCHS_AT_FOUR} epochs at world size 4", timeout)

    left = cluster.leave("B")
    log.action("node B leaves (SIGTERM to its agent)", left, expect=2, cause="leave")
    _wait_for(cluster, log, lambda: _epochs_at(log, 2, left) >= EPOCHS_BEFORE_CRASH,
              f"{EPOCHS_BEFORE_CRASH} epochs at world size 2 after the departure", timeout)

    check_crash_lands(log, settings.epochs)
    killed = cluster.kill_worker("A", local_rank=1)
    log.action("a worker of node A is killed (SIGKILL)", killed, expect=2, cause="crash")
    _wait_for(cluster, log, lambda: any(e["event"] == "finished" for e in log.worker_events),
              "the end of training", timeout + settings.epochs * 10 * settings.step_delay)
    _wait_for(cluster, log, lambda: not node_a.alive, "node A to exit", 30, exit_expected=True)
    if node_a.process.returncode != 0:
        raise DemoError(f"node A exited with code {node_a.process.returncode}")
    log.action("node A exits: training finished", time.monotonic())


def run_cli(args: list[str], timeout_s: float = 150.0,
            echo: Callable[[str], None] = print) -> int:
    """Run ``python -m ddpguide.elastic ARGS`` in a child, echoing its lines as they come.

    For notebooks: the output appears live, and after ``timeout_s`` the child
    and everything it started are killed. Returns the exit code.
    """
    import sys

    from ddpguide.launch import ranks

    command = ranks.Command([sys.executable, "-m", "ddpguide.elastic", *args], {"PYTHONUNBUFFERED": "1"})

    def lines(text: str) -> None:
        for line in text.splitlines():
            echo(line)

    shown = ranks.run([command], timeout_s, lines)
    if shown.timed_out:
        echo(f"error: stopped after {timeout_s:g} s")
    return shown.returncodes[0] if shown.returncodes[0] is not None else -9
