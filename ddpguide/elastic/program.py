"""The chapter's program, ``book/programs/elastic_train.py``, under two real torchrun agents.

:func:`run_join` starts agent A alone on the loopback interface and agent B as
soon as A's workers have logged an epoch, both with the reader's command;
:func:`check_join` proves from what the program wrote (its ``--epoch-log``
JSON lines and its checkpoint) that every epoch ran exactly once while the
world size went from A's workers alone to A's and B's together.
:func:`run_scale_up_hang` runs the same two agents without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, with a short ``read_timeout``: agent B
then fails within seconds on the key that nobody writes.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from ddpguide.core import scratch
from ddpguide.core.processes import store_port
from ddpguide.elastic.settings import AgentSettings
from ddpguide.launch.programs import path_of
from ddpguide.launch.report import read_log
from ddpguide.launch.torchrun import FAILURE_GRACE_S, Agent, AgentRun, node_devices, run_agents

PROGRAM = "elastic_train.py"
LOG = "epochs.jsonl"


@dataclass
class JoinRun:
    """Two agents' runs of the program, and the folder it ran in."""

    agents: list[AgentRun]
    workdir: Path
    epochs: int
    nproc_per_node: int = 1

    @property
    def rdzv_id(self) -> str:
        """The rendezvous id both agents were given (``--rdzv-id``)."""
        option = next(a for a in self.agents[0].agent.torchrun_args if a.startswith("--rdzv-id="))
        return option.partition("=")[2]

    def records(self) -> list[dict]:
        """The program's epoch log (a live log: :func:`ddpguide.launch.report.read_log`): one
        dict per finished epoch, in the order written."""
        return read_log(self.workdir / LOG)


def agent_settings(port: int, nproc_per_node: int = 1, share_store: bool = False,
                   read_timeout: int | None = None, nnodes: str = "1:2",
                   host: str = "127.0.0.1") -> AgentSettings:
    """The tuned agent of the chapter: ``--nnodes=1:2`` on 127.0.0.1, monitor every 0.5 s.

    ``share_store`` leaves torchrun's store sharing on (no workaround variable);
    ``read_timeout`` bounds every wait on the rendezvous store (torchrun's default: 60 s);
    ``nnodes`` and ``host`` (the rendezvous endpoint's) for agents on other machines.
    """
    settings = AgentSettings(nnodes=nnodes, nproc_per_node=nproc_per_node,
                             rdzv_endpoint=f"{host}:{port}",
                             rdzv_id=f"job-{uuid.uuid4().hex[:8]}", max_restarts=3,
                             monitor_interval=0.5, share_store=share_store)
    if read_timeout is not None:
        settings.rdzv_conf["read_timeout"] = str(read_timeout)
    return settings.validate()


def program_folder() -> Path:
    """A new folder holding a copy of the program alone, as a reader's folder (removed by the
    caller, at the latest when this interpreter exits: :mod:`ddpguide.core.scratch`)."""
    workdir = scratch.folder("ddpguide-elastic-program-")
    shutil.copy(path_of(PROGRAM), workdir / PROGRAM)
    return workdir


def run_join(epochs: int = 24, epoch_seconds: float = 0.4, nproc_per_node: int = 1,
             join_after_epoch: int = 1, timeout: float = 150.0, share_store: bool = False,
             read_timeout: int | None = None, a_read_timeout: int | None = None,
             failure_grace_s: float = FAILURE_GRACE_S) -> JoinRun:
    """Run the program under agent A; start agent B once epoch ``join_after_epoch`` is logged.

    Both agents run the same command in the same folder (a copy of the program);
    every process is gone when this returns, even on a timeout. ``share_store``
    and ``read_timeout`` go to :func:`agent_settings` (``a_read_timeout``, when given,
    is A's instead); ``failure_grace_s`` is how long one agent may run on after the
    other has failed.
    """
    workdir = program_folder()
    settings = agent_settings(store_port(), nproc_per_node, share_store, read_timeout)
    a_settings = settings if a_read_timeout is None else replace(
        settings, rdzv_conf={**settings.rdzv_conf, "read_timeout": str(a_read_timeout)})
    args = ("--epochs", str(epochs), "--epoch-seconds", f"{epoch_seconds:g}", "--epoch-log", LOG)

    def agent(name: str, chosen: AgentSettings, start_when=None) -> Agent:
        # each loopback node its own GPUs, or the CPU for both: nccl refuses two ranks on one GPU
        devices = node_devices("AB".index(name), nproc_per_node)
        return Agent(name, torchrun_args=tuple(chosen.torchrun_args()), module=PROGRAM, module_args=args,
                     env={**chosen.environment(), **devices}, cwd=str(workdir), start_when=start_when)

    def a_has_trained() -> bool:
        return any(r["epoch"] >= join_after_epoch for r in read_log(workdir / LOG))

    agents = [agent("A", a_settings), agent("B", settings, a_has_trained)]
    runs = run_agents(agents, timeout=timeout, failure_grace_s=failure_grace_s)
    return JoinRun(runs, workdir, epochs, nproc_per_node)


def run_scale_up_hang(read_timeout: int = 5, epoch_seconds: float = 0.4,
                      timeout: float = 90.0) -> JoinRun:
    """:func:`run_join` with torchrun's store sharing on: the late agent B never joins.

    B waits for ``MASTER_ADDR`` under the keys of the round it joined, which
    nobody writes, and fails after ``read_timeout`` seconds with a
    ``DistStoreError`` (torchrun's default read timeout is 60 s). A waits for B's
    role in that round and fails the same way, after twice ``read_timeout``: A hosts
    the rendezvous store, and were A first to end, B's wait would end on a closed
    connection instead (on an idle machine B's wait starts about a second before A's;
    on a loaded one, B can be the later to see the round complete). A may take
    ``read_timeout`` + 10 s to end after B (it stops its workers first).
    """
    return run_join(epochs=24, epoch_seconds=epoch_seconds, join_after_epoch=0,
                    timeout=timeout, share_store=True, read_timeout=read_timeout,
                    a_read_timeout=2 * read_timeout, failure_grace_s=read_timeout + 10.0)


def store_errors(run: JoinRun) -> dict[str, str]:
    """Each agent's last ``DistStoreError`` line, by agent name (agents without one left out)."""
    errors = {}
    for agent_run in run.agents:
        lines = [line for line in agent_run.lines() if "DistStoreError:" in line]
        if lines:
            errors[agent_run.agent.name] = lines[-1].strip()
    return errors


class JoinFailed(AssertionError):
    """What the chapter claims about the join did not hold (raised, so ``python -O`` keeps it)."""


def _require(holds: bool, claim: str, found: object) -> None:
    if not holds:
        raise JoinFailed(f"{claim}: {str(found)[-2000:]}")


def check_join(run: JoinRun) -> dict:
    """Check what the chapter claims about the run (:class:`JoinFailed` names the first claim
    that fails); return the facts it checked.

    Both agents exit 0; the log holds every epoch exactly once, in order; the
    world size only grows, from A's workers to A's and B's; a join is not a
    failure (the restart count stays 0); the new group's rank 0 says it resumed at
    the first epoch it logged; the checkpoint holds the last epoch.
    """
    import torch

    _require([r.returncode for r in run.agents] == [0, 0], "both agents exit 0",
             [(r.returncode, r.lines()[-5:]) for r in run.agents])
    records = run.records()
    epochs = [r["epoch"] for r in records]
    _require(epochs == list(range(run.epochs)), f"epochs 0..{run.epochs - 1} once each, in order", epochs)
    sizes = [r["world_size"] for r in records]
    per_node = run.nproc_per_node
    _require(sizes[0] == per_node and sizes[-1] == 2 * per_node and sizes == sorted(sizes),
             f"the world size grows from {per_node} to {2 * per_node}", sizes)
    _require({r["restart_count"] for r in records} == {0}, "the restart count stays 0", records)
    state = torch.load(run.workdir / "checkpoint.pt", map_location="cpu", weights_only=True)
    _require(state["epoch"] == run.epochs - 1, f"the checkpoint holds epoch {run.epochs - 1}", state["epoch"])
    first_at_two = sizes.index(sizes[-1])
    said = "\n".join(line for r in run.agents for line in r.lines())
    # the new group's rank 0 found the checkpoint and said where it resumed (the line the
    # chapter quotes)
    line = f"world size {sizes[-1]}, restart count 0: resuming at epoch {first_at_two}"
    _require(line in said, f"rank 0 printed {line!r}", said)
    return {"epochs": len(epochs), "world_sizes": sorted(set(sizes)),
            "joined_before_epoch": first_at_two, "checkpoint_epoch": state["epoch"]}
