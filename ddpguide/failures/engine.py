"""Run ``ft_train.py`` as torchft deploys it: the lighthouse as its own process, one torchrun
job per replica group (restarted by torchrun), and the report assembled from the ranks' rows.

``Job`` starts everything through the one runner (:class:`ddpguide.launch.ranks.Ranks`), so
every process it starts carries the runner's marker variable; a reaper process kills what
carries it if this process dies without stopping them (SIGKILL leaves no time to). After
the run the ranks' JSON lines become one report, written whole (a temporary file, then a
rename) in the ``launch.report`` contract: one check per invariant, and the rows.

Placement (``Settings.cluster``): empty, everything on this machine's loopback; the run id of
a live cluster of chapter 15 (``ddpguide.cluster``), group g on node g and the lighthouse on
node 0, each started inside its node's namespaces (``Cluster.prefix``) with the node's
interface for gloo. Then every address a process is given is a node's: the lighthouse's, and
each group's torchrun rendezvous (c10d at its node's address, so that the store torchft's
quorums meet in is reachable from the other nodes); the nodes' names resolve to their
addresses inside every node (the cluster's hosts files), so the Managers' own addresses
(their host names) do too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpguide.cluster.cluster import Cluster, chosen
from ddpguide.cluster.spec import Node
from ddpguide.core.processes import alive, descendants, processes_with_env, store_port
from ddpguide.failures import sockets
from ddpguide.launch import programs
from ddpguide.launch import report as reports
from ddpguide.launch.ranks import LAUNCH_ID_VARIABLE, Command, Ranks

PROGRAM = "ft_train.py"
STOP = "stop"   # the file a run's last step is written to, when it ends before --steps
EVENTS = ("started", "contributed", "step", "healed", "checkpoint", "final", "inner", "sync")


@dataclass(frozen=True)
class Settings:
    """One run: its groups, their size, the program's options, torchrun's and the lighthouse's."""

    groups: int = 2
    group_size: int = 1
    steps: int = 40
    step_seconds: float = 0.1
    seed: int = 0
    lr: float = 0.1
    hidden: int = 10
    state_mb: int = 0               # the program's --state-mb: more state that a heal moves
    max_restarts: int = 5
    min_replicas: int = 1           # the lighthouse's: groups a quorum needs (1: survivors go on)
    timeout_s: int = 5              # the program's collective, quorum and heal timeout
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 1000
    quorum_tick_ms: int = 100
    deadline_s: float = 180.0
    extra: tuple[str, ...] = field(default_factory=tuple)
    cluster: str = ""               # a live cluster's run id: a group a node (module docstring)

    def problem(self) -> str | None:
        """Why these settings cannot run (one line), or None."""
        if self.groups < 2:
            return f"--groups {self.groups}: at least 2 (a survivor to heal from)"
        if self.group_size not in (1, 2):
            return f"--group-size {self.group_size}: 1 (DDP) or 2 (FSDP2 in the group)"
        if not 1 <= self.min_replicas <= self.groups:
            return f"--min-replicas {self.min_replicas}: 1 to --groups"
        if self.steps < 1:
            return f"--steps {self.steps}: at least 1"
        if self.state_mb < 0:
            return f"--state-mb {self.state_mb}: 0 or more"
        if self.max_restarts < 0 or self.deadline_s <= 0 or self.step_seconds < 0:
            return "--max-restarts, --step-seconds must be 0 or more and --deadline positive"
        if self.cluster:
            try:
                nodes = len(chosen(self.cluster).nodes)
            except LookupError as e:
                return str(e)
            if nodes < self.groups:
                return (f"--cluster {self.cluster}: {nodes} nodes for {self.groups} groups "
                        "(a group a node)")
        return None


def lighthouse_argv(settings: Settings, port: int) -> list[str]:
    """The command a reader types to start torchft's lighthouse."""
    return [str(Path(sys.executable).with_name("torchft_lighthouse")),
            "--min_replicas", str(settings.min_replicas),
            "--bind", f"[::]:{port}", "--join_timeout_ms", str(settings.join_timeout_ms),
            "--heartbeat_timeout_ms", str(settings.heartbeat_timeout_ms),
            "--quorum_tick_ms", str(settings.quorum_tick_ms)]


def group_argv(settings: Settings, group: int, rdzv_port: int, folder: Path,
               node: Node | None = None) -> list[str]:
    """The torchrun command of one replica group: on one machine ``--standalone``; on a
    cluster's ``node``, a rendezvous of one node at the node's address."""
    rendezvous = (["--standalone", f"--rdzv-endpoint=127.0.0.1:{rdzv_port}"] if node is None else
                  ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-id=group{group}",
                   f"--rdzv-endpoint={node.address}:{rdzv_port}"])
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
            f"--nproc-per-node={settings.group_size}",
            f"--max-restarts={settings.max_restarts}", "--monitor-interval=0.1",
            f"--log-dir={folder / 'torchrun' / f'group{group}'}",
            str(programs.path_of(PROGRAM)), "--rows", str(folder / "rows"),
            "--steps", str(settings.steps), "--step-seconds", str(settings.step_seconds),
            "--seed", str(settings.seed), "--lr", str(settings.lr), "--hidden", str(settings.hidden),
            "--timeout", str(settings.timeout_s),
            *(["--state-mb", str(settings.state_mb)] if settings.state_mb else []),
            # a survivor that has finished waits for the restarted groups as long as the run may
            # take: one that left early would leave a late group no peer to heal from
            "--linger", str(settings.deadline_s), "--stop-file", str(folder / STOP),
            *settings.extra]


def group_env(group: int, groups: int, lighthouse: str, node: Node | None = None) -> dict[str, str]:
    return {"REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": str(groups),
            "TORCHFT_LIGHTHOUSE": lighthouse, "GLOO_SOCKET_IFNAME": "lo" if node is None
            else node.ifname, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"}


class Job:
    """The lighthouse and every group's torchrun, running; ``with`` stops them all."""

    def __init__(self, settings: Settings, folder: str | os.PathLike):
        self.settings = settings
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ranks = Ranks(workdir=self.folder)
        self.cluster: Cluster | None = chosen(settings.cluster) if settings.cluster else None
        self.lighthouse_port = store_port()   # below the ephemeral range: no client takes it
        host = "127.0.0.1" if self.cluster is None else self.cluster.nodes[0].address
        self.lighthouse_url = f"http://{host}:{self.lighthouse_port}"
        self.commands: list[str] = []
        self.reaper: subprocess.Popen | None = None
        self.lighthouse = -1
        self.agents: list[int] = []
        self.started = time.time()

    def start(self) -> Job:
        self.reaper = subprocess.Popen(   # kills the marked processes if this one dies
            [sys.executable, "-m", "ddpguide.failures.reaper", str(os.getpid()),
             self.ranks.launch_id], stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self.start_lighthouse()
        deadline = time.monotonic() + 60   # a loaded machine: seconds before it listens
        while not self.lighthouse_listens():
            if time.monotonic() > deadline or not self.ranks.alive(self.lighthouse):
                self.ranks.tail.poll()
                raise RuntimeError(f"the lighthouse did not start (exit status "
                                   f"{self.ranks.returncode(self.lighthouse)}, port "
                                   f"{self.lighthouse_port}):\n{self.ranks.ended().output}")
            time.sleep(0.05)
        for g in range(self.settings.groups):
            node = self.node_of(g)
            argv = group_argv(self.settings, g, store_port(), self.folder, node)
            env = group_env(g, self.settings.groups, self.lighthouse_url, node)
            self.commands.append(" ".join([*(f"{k}={env[k]}" for k in list(env)[:3]),
                                           "torchrun", *argv[3:]]))
            self.agents.append(self.ranks.start(Command(argv, env=env, cwd=str(self.folder),
                                                        name=f"group{g}",
                                                        prefix=self.prefix(node))))
        return self

    def node_of(self, group: int) -> Node | None:
        """The node ``group`` runs on (None: this machine); node 0 for the lighthouse."""
        return None if self.cluster is None else self.cluster.nodes[group]

    def prefix(self, node: Node | None) -> list[str]:
        return [] if self.cluster is None or node is None else self.cluster.prefix(node)

    def lighthouse_listens(self) -> bool:
        if self.cluster is None:
            return programs.load(PROGRAM).lighthouse_reachable(self.lighthouse_url, 0.2)
        return sockets.listening(self.ranks.pid(self.lighthouse), self.lighthouse_port)

    def set_link(self, group: int, up: bool) -> None:
        """Take the link of ``group``'s node down (a cable pulled), or bring it back up."""
        node = self.node_of(group)
        if self.cluster is None or node is None:
            raise ValueError("a link is cut on a cluster only (Settings.cluster)")
        self.cluster.set_link(node, up)

    def start_lighthouse(self) -> None:
        argv = lighthouse_argv(self.settings, self.lighthouse_port)
        if not self.commands:
            self.commands.append(" ".join(["torchft_lighthouse", *argv[1:]]))
        self.lighthouse = self.ranks.start(Command(argv, cwd=str(self.folder), name="lighthouse",
                                                   env={"RUST_LOG": "error"},
                                                   prefix=self.prefix(self.node_of(0))))

    def ranks_of(self, group: int) -> list[int]:
        """The pids of the training ranks of ``group`` now: the children of its torchrun agent."""
        agent = self.ranks.pid(self.agents[group])
        return [p for p in descendants(agent) if _is_rank(p)]

    def running(self) -> bool:
        return any(self.ranks.alive(a) for a in self.agents)

    def wait(self, until_s: float) -> bool:
        """Wait until every group's torchrun has ended or ``until_s`` (monotonic); True if ended."""
        while self.running():
            if time.monotonic() >= until_s:
                return False
            self.ranks.tail.poll()
            time.sleep(0.05)
        return True

    def stop(self) -> list[int]:
        """Stop everything; the pids of the job found alive after (none, when all went well)."""
        self.ranks.stop(grace=2.0)
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait(10)
        return [p for p in processes_with_env(LAUNCH_ID_VARIABLE, self.ranks.launch_id)
                if alive(p) and p != os.getpid()]

    def __enter__(self) -> Job:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_rank(pid: int) -> bool:
    try:
        return PROGRAM.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_rows(folder: Path) -> list[dict]:
    """Every rank's rows, in time order: each rank's file is a live log
    (:func:`ddpguide.launch.report.read_log`; a row cut short by a kill is left out)."""
    rows = [row for path in sorted((folder / "rows").glob("*.jsonl")) for row in reports.read_log(path)]
    return sorted(rows, key=lambda r: r["time"])


def stop_at(folder: Path, step: int) -> None:
    """End the run at ``step`` (the program's --stop-file): written whole, then renamed."""
    (folder / (STOP + ".tmp")).write_text(str(step))
    os.replace(folder / (STOP + ".tmp"), folder / STOP)


def last_step(settings: Settings, folder: Path) -> int:
    """The step the run ends at: --steps, or the one written by ``stop_at``."""
    stop = folder / STOP
    return min(settings.steps, int(stop.read_text())) if stop.exists() else settings.steps


def assemble(settings: Settings, rows: list[dict], steps: int | None = None,
             **more: object) -> dict:
    """The report's body (before its checks): the settings (``steps``: where the run ended,
    when not --steps) and the rows by event."""
    report: dict = {"groups": settings.groups, "group_size": settings.group_size,
                    "steps": settings.steps if steps is None else steps, "seed": settings.seed, "lr": settings.lr,
                    "hidden": settings.hidden, "state_mb": settings.state_mb, **more}
    for event in EVENTS:
        report[event] = [r for r in rows if r["event"] == event]
    return report


def write_report(path: str | os.PathLike, report: dict) -> None:
    """Whole or not at all: a temporary file, then a rename."""
    path = Path(path)
    path.with_name(path.name + ".tmp").write_text(json.dumps(report))
    os.replace(path.with_name(path.name + ".tmp"), path)


def terminate(signum: int, frame: object) -> None:
    """SIGTERM ends the engine as an exception does: every ``with Job`` stops its processes."""
    raise SystemExit(128 + signum)


def on_sigterm() -> None:
    signal.signal(signal.SIGTERM, terminate)
