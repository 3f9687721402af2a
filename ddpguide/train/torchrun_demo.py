"""The chapter's torchrun demonstrations: two nodes on one machine, and the error file.

* :func:`two_nodes_static`: two agents on 127.0.0.1, each told its node rank
  on the command line (``--node-rank``), as in the source article's table;
* :func:`two_nodes_c10d`: the same two agents with one identical command; a
  c10d rendezvous numbers the nodes;
* :func:`crash_demo`: the chapter's program, ``ddp_torchrun.py``, with one rank
  raising on purpose (``--crash-rank``), and what torchrun's error files make of it.

Every launch goes through :func:`ddpguide.launch.torchrun.run_agents`: bounded
in time, and no process left behind.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddpguide.core.processes import ephemeral_port
from ddpguide.launch.programs import path_of
from ddpguide.launch.torchrun import (
    DEFAULT_TIMEOUT_S,
    Agent,
    AgentRun,
    node_devices,
    run_agents,
)
from ddpguide.launch.whoami import NODE_NAME_VARIABLE, read_records


class PortInUse(RuntimeError):
    """Every attempt found its rendezvous port taken by another program."""


@dataclass
class NodesRun:
    """What the workers of a multi-agent launch reported, and how the agents ended."""

    records: list[dict[str, Any]]   # one per worker, sorted by RANK
    runs: list[AgentRun]
    attempts: int = 1               # launches needed (a taken port forces a new one)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.runs)


def _port_taken(runs: Sequence[AgentRun]) -> bool:
    return any("EADDRINUSE" in r.output for r in runs)


def _whoami_launch(make_agents, timeout: float, attempts: int) -> NodesRun:
    """Launch whoami agents, on a fresh port, again only if the port was taken meanwhile."""
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="ddpguide-whoami-") as out:
            agents = make_agents(ephemeral_port(), out)
            runs = run_agents(agents, timeout=timeout)
            if _port_taken(runs) and attempt < attempts:
                continue
            if _port_taken(runs):
                raise PortInUse(f"the rendezvous port was taken {attempts} times in a row")
            return NodesRun(read_records(out), runs, attempt)
    raise AssertionError("unreachable")


def two_nodes_static(nproc_per_node: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                     attempts: int = 3) -> NodesRun:
    """Two agents on 127.0.0.1, ``--nnodes=2``, each told its ``--node-rank`` on the command line.

    Node rank 0 hosts the store on ``--master-port``; both must agree on it.
    """
    def agents(port: int, out: str) -> list[Agent]:
        return [
            Agent(name, ("--nnodes=2", f"--node-rank={node_rank}",
                         f"--nproc-per-node={nproc_per_node}",
                         "--master-addr=127.0.0.1", f"--master-port={port}"),
                  "ddpguide.launch.whoami", ("--out", out),
                  {NODE_NAME_VARIABLE: name, **node_devices(node_rank, nproc_per_node)})
            for node_rank, name in enumerate(("node-A", "node-B"))
        ]
    return _whoami_launch(agents, timeout, attempts)


def two_nodes_c10d(nproc_per_node: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                   attempts: int = 3) -> NodesRun:
    """Two agents with the same command: a c10d rendezvous at 127.0.0.1 assigns the node ranks.

    On one machine both agents match the endpoint's host, so ``is_host`` says
    which one hosts the rendezvous store (on a cluster the endpoint's machine
    does). Which node becomes group rank 0 is the rendezvous's decision.
    """
    run_id = f"ddpguide-{uuid.uuid4().hex[:8]}"

    def agents(port: int, out: str) -> list[Agent]:
        return [
            Agent(name, ("--nnodes=2", f"--nproc-per-node={nproc_per_node}",
                         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                         f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(hosts)}"),
                  "ddpguide.launch.whoami", ("--out", out),
                  {NODE_NAME_VARIABLE: name, **node_devices(node, nproc_per_node)})
            for node, (name, hosts) in enumerate((("node-A", True), ("node-B", False)))
        ]
    return _whoami_launch(agents, timeout, attempts)


RANK_TABLE_COLUMNS = ("node_name", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")


def rank_table(records: Sequence[Mapping[str, Any]],
               columns: Sequence[str] = RANK_TABLE_COLUMNS) -> str:
    """The reported records as a text table, one row per worker."""
    rows = [[str(r.get(c)) for c in columns] for r in records]
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


# --- the error file ----------------------------------------------------------------------

@dataclass(frozen=True)
class ErrorSummary:
    """The essentials of one torchrun error file, without the multi-line traceback."""

    exception: str      # "ExceptionType: message"
    file: str           # where it was raised (innermost frame)
    line: int
    function: str
    timestamp: int

    @property
    def cause(self) -> str:
        """The exception's first sentence, whole: gloo names the cause at its end."""
        return self.exception.split(". ")[0]

    def __str__(self) -> str:
        return f"{self.cause}  ({Path(self.file).name}:{self.line}, in {self.function})"


def summarize_error(error: Mapping[str, Any]) -> ErrorSummary:
    """Read an error file written by ``@record``: exception line and innermost frame."""
    message = error["message"]
    if isinstance(message, str):  # the older flat format
        return ErrorSummary(message, "?", 0, "?", int(error.get("timestamp", 0)))
    callstack = message.get("extraInfo", {}).get("py_callstack", "")
    frames = [line.strip() for line in callstack.splitlines() if line.strip().startswith('File "')]
    file, lineno, function = "?", 0, "?"
    if frames:
        # File "/path/x.py", line 12, in run
        head, _, function = frames[-1].rpartition(", in ")
        file_part, _, line_part = head.rpartition(", line ")
        file, lineno = file_part[len('File "'):-1], int(line_part)
    return ErrorSummary((message["message"].splitlines() or [""])[0], file, lineno, function,
                        int(message.get("extraInfo", {}).get("timestamp", 0)))


@dataclass
class CrashRun:
    """A torchrun launch in which one rank raised on purpose."""

    run: AgentRun
    crash_rank: int

    @property
    def errors(self) -> dict[int, ErrorSummary]:
        """Every worker's error file, by local rank (one node: local rank = rank)."""
        return {rank: summarize_error(e) for rank, e in sorted(self.run.error_files.items())}

    @property
    def root_cause(self) -> ErrorSummary | None:
        """The failure torchrun copied into the agent's own error file."""
        return summarize_error(self.run.root_cause) if self.run.root_cause else None


CRASH_PROGRAM = "ddp_torchrun.py"  # the chapter's program; it wraps main() in @record


def crash_demo(nproc_per_node: int = 2, crash_rank: int = 1,
               timeout: float = DEFAULT_TIMEOUT_S,
               monitor_interval: float | None = None) -> CrashRun:
    """``torchrun --standalone ddp_torchrun.py --crash-rank R``: rank R raises before training.

    The program runs from a fresh folder holding only its copy, as a reader runs it.
    ``monitor_interval`` is torchrun's ``--monitor-interval`` (default 0.1 s): how often the
    agent looks at its workers. A few seconds leave the other ranks time to fail by themselves
    (and write their error files) before the agent stops them.
    """
    interval = () if monitor_interval is None else (f"--monitor-interval={monitor_interval:g}",)
    folder = Path(tempfile.mkdtemp(prefix="ddpguide-crash-"))
    try:
        shutil.copy(path_of(CRASH_PROGRAM), folder / CRASH_PROGRAM)
        agent = Agent("agent", ("--standalone", f"--nproc-per-node={nproc_per_node}", *interval),
                      CRASH_PROGRAM, ("--epochs", "1", "--crash-rank", str(crash_rank)),
                      cwd=str(folder))
        run = run_agents([agent], timeout=timeout)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return CrashRun(run, crash_rank)


_SUMMARY_FIELD = re.compile(r"^\s+(time|host|rank|exitcode)\s*:\s*(.*)$")


def failure_summary(output: str) -> list[dict[str, str]]:
    """The failed workers listed in torchrun's "FAILED" report, without their tracebacks.

    One dict per entry, with ``section`` ("root cause" or "other failure") and
    the report's ``time``, ``host``, ``rank`` and ``exitcode`` fields.
    """
    entries: list[dict[str, str]] = []
    section = None
    for line in output.splitlines():
        if line.startswith("Failures:"):
            section = "other failure"
        elif line.startswith("Root Cause"):
            section = "root cause"
        elif line.startswith("====="):
            section = None
        elif section and re.match(r"^\[\d+\]:", line):
            entries.append({"section": section})
        elif section and entries and (match := _SUMMARY_FIELD.match(line)):
            entries[-1].setdefault(match[1], match[2].strip())
    return entries


def draw_layout(records: Sequence[Mapping[str, Any]], ax, title: str = "") -> None:
    """Draw nodes as boxes and their workers inside, labelled with RANK and LOCAL_RANK."""
    from matplotlib.patches import FancyBboxPatch

    nodes: dict[int, list[Mapping[str, Any]]] = {}
    for record in records:
        nodes.setdefault(int(record["GROUP_RANK"]), []).append(record)
    width = max(len(w) for w in nodes.values())
    for group, workers in sorted(nodes.items()):
        x0 = group * (width + 0.6)
        ax.add_patch(FancyBboxPatch((x0, 0), width, 1.6, boxstyle="round,pad=0.05",
                                    facecolor="#eef3fb", edgecolor="#4a6fa5"))
        name = workers[0].get("node_name") or f"node {group}"
        ax.text(x0 + width / 2, 1.42, f"{name}: GROUP_RANK {group}", ha="center", fontsize=9)
        ax.text(x0 + width / 2, 1.25, f"agent pid {workers[0].get('parent_pid', '?')}",
                ha="center", fontsize=7, color="#555555")
        for worker in sorted(workers, key=lambda w: int(w["LOCAL_RANK"])):
            x = x0 + int(worker["LOCAL_RANK"]) + 0.1
            ax.add_patch(FancyBboxPatch((x, 0.1), 0.8, 1.0, boxstyle="round,pad=0.02",
                                        facecolor="#ffffff", edgecolor="#888888"))
            ax.text(x + 0.4, 0.78, f"RANK {worker['RANK']}", ha="center", fontsize=9, weight="bold")
            ax.text(x + 0.4, 0.4, f"LOCAL_RANK\n{worker['LOCAL_RANK']}", ha="center", va="center",
                    fontsize=7)
    ax.set_xlim(-0.2, len(nodes) * (width + 0.6) - 0.4)
    ax.set_ylim(-0.1, 1.8)
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
