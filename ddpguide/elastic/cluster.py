"""A cluster of torchrun agents on this machine, for the demo, the benchmark and the tests.

Each "node" is one ``python -m ddpguide.elastic node`` process (a torchrun
agent) in a process group of its own, with its log in the work directory.
The cluster can add a node, let one leave (SIGTERM: the agent stops its
workers and exits), lose one (SIGKILL of the agent and its workers, as if the
machine died), and kill one worker. Closing the cluster kills whatever is left:
no agent or worker survives it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpguide.core.processes import DIE_WITH_PARENT_ENV, descendants, signal_all, store_port
from ddpguide.elastic.events import EventTail
from ddpguide.elastic.worker_args import STRATEGIES, WorkerArgs
from ddpguide.launch import ranks
from ddpguide.launch.torchrun import node_devices

LOOPBACK = "127.0.0.1"
# gloo picks the interface of the machine's hostname unless told otherwise.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


@dataclass
class Node:
    """One agent process (rank ``index`` of the cluster's group) and where its output goes."""

    name: str
    nproc: int
    process: subprocess.Popen
    log: Path
    started: float
    stopped: float | None = None
    index: int = 0

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalCluster:
    """torchrun agents on 127.0.0.1 sharing one checkpoint and one event file."""

    workdir: Path
    epochs: int = WorkerArgs.epochs
    step_delay: float = WorkerArgs.step_delay
    nnodes: str = "1:3"
    max_restarts: int = 3
    torchrun_defaults: bool = False
    samples: int = WorkerArgs.samples
    strategy: str = WorkerArgs.strategy
    port: int = field(default_factory=store_port)
    nodes: dict[str, Node] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)  # each node's slice of the GPUs
    all_events: list[dict] = field(default_factory=list)
    store: subprocess.Popen | None = None
    group: ranks.Ranks = field(default_factory=ranks.Ranks, repr=False)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # one file that rank 0 writes, or (sharded) a directory of every rank's shards
        self.checkpoint = self.workdir / STRATEGIES[self.strategy].checkpoint_name
        self.events_path = self.workdir / "events.jsonl"
        self.events = EventTail(self.events_path)

    # -- starting ---------------------------------------------------------
    def node_command(self, name: str, nproc: int) -> list[str]:
        """The command line of one node (node mode of this package)."""
        worker = WorkerArgs(checkpoint=str(self.checkpoint), epochs=self.epochs,
                            events=str(self.events_path), step_delay=self.step_delay,
                            samples=self.samples, strategy=self.strategy)
        cmd = [sys.executable, "-m", "ddpguide.elastic", "node",
               "--nnodes", self.nnodes, "--nproc-per-node", str(nproc),
               "--rdzv-endpoint", f"{LOOPBACK}:{self.port}", "--rdzv-id", "ddpguide-demo",
               "--max-restarts", str(self.max_restarts), "--local-addr", LOOPBACK,
               "--node-name", name, *worker.argv(node=True)]
        if self.torchrun_defaults:
            cmd.append("--torchrun-defaults")
        if self.store is not None:
            cmd.append("--external-store")
        return cmd

    def start_store(self, timeout_s: float = 60.0) -> None:
        """Host the rendezvous store in a process of its own (before any node starts)."""
        index = self.group.start(ranks.Command(store_command(self.port), {DIE_WITH_PARENT_ENV: "1"},
                                               name="store", log=self.workdir / "store.log"))
        self.store = self.group.processes[index]
        self.wait_for_store(timeout_s)

    def go_file(self, name: str) -> Path:
        return self.workdir / f"node-{name}.go"

    def start_node(self, name: str, nproc: int = 2, on_cue: bool = False) -> Node:
        """Start an agent with ``nproc`` workers; it joins the running job (or starts it).

        With ``on_cue`` the agent imports everything, reports ``agent_waiting``
        and joins only at :meth:`join`: the join then measures elasticity, not
        Python start-up.
        """
        log = self.workdir / f"node-{name}.log"
        slot = self.slots.setdefault(name, len(self.slots))  # a node that comes back keeps its GPUs
        env = {**LOOPBACK_ENV, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", DIE_WITH_PARENT_ENV: "1",
               **node_devices(slot, nproc)}  # nccl refuses two ranks on one GPU
        command = self.node_command(name, nproc)
        if on_cue:
            command += ["--start-when", str(self.go_file(name))]
        index = self.group.start(ranks.Command(command, env, name=name, log=log))
        node = Node(name, nproc, self.group.processes[index], log, time.monotonic(), index=index)
        self.nodes[name] = node
        return node

    def wait_for_store(self, timeout_s: float = 60.0) -> None:
        """Block until something listens on the rendezvous port (the first agent's store).

        Raises at once, with the agent's log, when an agent that should be
        starting has exited instead; after ``timeout_s`` with every agent's log.
        """
        def listening() -> bool:
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex((LOOPBACK, self.port)) == 0:
                    return True
            for name, node in self.nodes.items():
                if node.stopped is None and not node.alive:
                    raise RuntimeError(
                        f"node {name} exited with code {node.process.returncode} before the "
                        f"rendezvous store on port {self.port} was up; its log ends:\n"
                        f"{self.log_tail(name)}")
            return False

        if self.wait(listening, timeout_s):
            return
        logs = "\n".join(f"--- node {name} ---\n{self.log_tail(name)}" for name in self.nodes)
        raise TimeoutError(f"no rendezvous store on port {self.port} after {timeout_s:g} s\n{logs}")

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Poll the events until ``done()`` (True) or ``timeout_s`` s have passed (False)."""
        def until() -> bool:
            self.poll()
            return done()

        return self.group.wait(timeout_s, until=until, all_end=True) is ranks.Outcome.UNTIL or until()

    # -- disturbing -------------------------------------------------------
    def join(self, name: str) -> float:
        """Let a node started ``on_cue`` join now."""
        when = time.monotonic()
        self.go_file(name).touch()
        return when

    def leave(self, name: str) -> float:
        """Ask a node to leave (SIGTERM): the agent stops its workers and exits."""
        node = self.nodes[name]
        node.stopped = time.monotonic()
        self.group.signal(node.index, signal.SIGTERM, tree=False)
        return node.stopped

    def kill_node(self, name: str) -> float:
        """Lose a node: SIGKILL its agent and every worker at once, like a power cut."""
        node = self.nodes[name]
        node.stopped = time.monotonic()
        self.group.signal(node.index, signal.SIGKILL, tree=True)
        node.process.wait(10)
        return node.stopped

    def worker_pid(self, name: str, local_rank: int) -> int:
        """The pid of the newest worker with ``local_rank`` on node ``name`` (from its events)."""
        agent_children = set(descendants(self.nodes[name].process.pid))
        candidates = [e["pid"] for e in self.all_events
                      if e["event"] == "spawned" and e["node"] == name
                      and e["local_rank"] == local_rank and e["pid"] in agent_children]
        if not candidates:
            raise RuntimeError(f"no running worker with local rank {local_rank} on node {name}")
        return candidates[-1]

    def kill_worker(self, name: str, local_rank: int = 1) -> float:
        """SIGKILL one worker, as if it crashed; its agent restarts the whole group."""
        pid = self.worker_pid(name, local_rank)
        when = time.monotonic()
        signal_all([pid], signal.SIGKILL)
        return when

    # -- watching ---------------------------------------------------------
    def poll(self) -> list[dict]:
        """New events since the last poll (also kept in ``all_events``)."""
        new = self.events.poll()
        self.all_events.extend(new)
        return new

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = self.nodes[name].log.read_text(errors="replace") if name in self.nodes else ""
        return "\n".join(text.splitlines()[-lines:])

    # -- ending -----------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        """Stop every node and the store: SIGTERM, then SIGKILL for anything still running."""
        self.group.stop(grace_s)
        self.group.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def store_command(port: int) -> list[str]:
    """The command line of a separate store process."""
    return [sys.executable, "-m", "ddpguide.elastic", "store", "--port", str(port)]


__all__ = ["LocalCluster", "Node", "store_command"]
