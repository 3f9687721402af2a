"""torchrun from Python: start agents as subprocesses, bounded in time, and read what they left.

A notebook cell or a test cannot type ``torchrun ...`` into a terminal, so
:func:`run_agents` starts one or more torchrun agents as subprocesses and waits
for them, with the habits a book needs:

* a hard time limit: on expiry every agent *and every worker it started* is
  stopped (torchrun starts each worker in a session of its own, so killing the
  agent's process group alone would leave the workers running);
* each agent gets its own ``--log-dir`` and ``TORCHELASTIC_ERROR_FILE`` in a
  temporary folder: the per-worker error files and the agent's root-cause file
  are read back before the folder is deleted;
* the environment the agents inherit is cleaned of launcher variables, so what
  a worker reports is what torchrun set, not what the caller happened to have.

The chapter's demonstrations built on it live in :mod:`ddpguide.train.torchrun_demo`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ddpguide.core.processes import processes_with_env
from ddpguide.core.runtime import LAUNCHER_VARIABLES
from ddpguide.launch import ranks

DEFAULT_TIMEOUT_S = 90.0
#: How long the other agents may run on after one agent has failed.
FAILURE_GRACE_S = 20.0
#: Marks every process of one launch (agents and workers inherit it).
LAUNCH_ID_VARIABLE = ranks.LAUNCH_ID_VARIABLE
#: An empty or star-only log line, e.g. ``W1129 14:16:04.750000 10112 torch/distributed/run.py:982] ****``.
_EMPTY_LOG_LINE = re.compile(r"^(?:[DIWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\])?\s*\**\s*$")
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class TorchrunTimeout(TimeoutError):
    """The agents did not finish in time; they and their workers were stopped."""

    def __init__(self, message: str, launch_id: str):
        super().__init__(message)
        self.launch_id = launch_id


@dataclass(frozen=True)
class Agent:
    """One torchrun invocation: its options, the module its workers run, extra environment."""

    name: str
    torchrun_args: tuple[str, ...]
    module: str                # a module name, or a script path ending in .py
    module_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    no_python: bool = False   # ``module`` is a program to run, not a Python module
    cwd: str | None = None    # the folder the agent starts in (a reader's program folder)
    #: Start this agent only once the condition holds (a node joining a running job).
    start_when: Callable[[], bool] | None = field(default=None, compare=False)

    def _entry(self) -> list[str]:
        if self.module.endswith(".py") and not self.no_python:  # a script, as `torchrun train.py`
            return [self.module, *self.module_args]
        return ["--no-python" if self.no_python else "-m", self.module, *self.module_args]

    def argv(self, log_dir: str | os.PathLike | None = None) -> list[str]:
        """The command as run: ``python -m torch.distributed.run`` is the ``torchrun`` script;
        with ``log_dir``, ``--log-dir`` first among torchrun's options (an agent's own
        ``--log-dir``, later, wins)."""
        logs = ["--log-dir", str(log_dir)] if log_dir is not None else []
        return [sys.executable, "-m", "torch.distributed.run", *logs, *self.torchrun_args,
                *self._entry()]

    def shell_command(self) -> str:
        """The same command as a reader would type it."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        command = shlex.join(["torchrun", *self.torchrun_args, *self._entry()])
        return f"{env} {command}" if env else command


@dataclass
class AgentRun:
    """What one agent did: exit status, merged output, error files."""

    agent: Agent
    returncode: int | None          # None: stopped at the time limit
    output: str
    seconds: float                  # wall time of the whole launch
    launch_id: str
    error_files: dict[int, dict] = field(default_factory=dict)  # local rank -> error JSON
    root_cause: dict | None = None  # the agent's own error file (torchrun copies the first failure)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def lines(self) -> list[str]:
        """Output lines without blanks and without the star banner around torchrun's warnings."""
        return [line for line in self.output.splitlines() if not _EMPTY_LOG_LINE.match(line)]


def agent_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher variables, plus ``extra``.

    The package's folder goes first on PYTHONPATH so the workers import the
    same ddpguide as the caller.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive in the order they were printed
    env.update(extra or {})
    return env


def processes_of_launch(launch_id: str) -> list[int]:
    """Live processes started by the launch ``launch_id``: agents, workers and their children.

    Every process of a launch carries ``DDPGUIDE_LAUNCH_ID=<id>``, which
    survives re-parenting: a worker whose agent was killed is still found.
    """
    return processes_with_env(LAUNCH_ID_VARIABLE, launch_id)


def _read_error_files(log_dir: Path) -> dict[int, dict]:
    """``<log-dir>/<run>/attempt_<n>/<local rank>/error.json`` of the last attempt, by local rank."""
    files: dict[int, dict] = {}
    for path in sorted(log_dir.glob("*/attempt_*/*/error.json")):
        try:
            files[int(path.parent.name)] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
    return files


def run_agents(agents: Sequence[Agent], timeout: float = DEFAULT_TIMEOUT_S,
               env: Mapping[str, str] | None = None, raise_on_timeout: bool = True,
               failure_grace_s: float = FAILURE_GRACE_S) -> list[AgentRun]:
    """Start the agents and wait for all of them, at most ``timeout`` seconds.

    Agents without ``start_when`` start at once; the others as soon as their
    condition holds (checked every 50 ms), e.g. when the first agent's workers
    have logged an epoch.

    When one agent fails, the others get ``failure_grace_s`` seconds to notice
    and stop on their own. Raises :class:`TorchrunTimeout` (after stopping all
    processes) when the time is up, unless ``raise_on_timeout`` is false, in
    which case the stopped agents have ``returncode`` None. In every case no
    process of the launch is left running when this returns.
    """
    names = [agent.name for agent in agents]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"agents need distinct names, got {names}")
    started = time.monotonic()
    with ranks.Ranks() as group:
        workdir = group.workdir
        by_agent: dict[str, int] = {}

        def launch(agent: Agent) -> None:
            agent_dir = workdir / agent.name
            agent_dir.mkdir()
            argv = agent.argv(log_dir=agent_dir / "logs")
            # The agent's own error file: the caller's if it names one, else one in the workdir.
            extra = {**(env or {}), "TORCHELASTIC_ERROR_FILE": str(agent_dir / "root_cause.json"),
                     **agent.env}
            by_agent[agent.name] = group.start(ranks.Command(
                argv, base_env=agent_environment(extra), cwd=agent.cwd, name=agent.name,
                log=agent_dir / "output.txt"))

        def late_start() -> bool:  # late agents start once their condition holds
            for agent in agents:
                if agent.name not in by_agent and agent.start_when is not None and agent.start_when():
                    launch(agent)
            return False

        for agent in agents:
            if agent.start_when is None:
                launch(agent)
        group.wait(timeout, until=late_start, failure_grace=failure_grace_s)
        stopped = {agent.name for agent in agents
                   if agent.name not in by_agent or group.alive(by_agent[agent.name])}
        group.stop()
        elapsed = time.monotonic() - started
        runs = []
        for agent in agents:
            agent_dir = workdir / agent.name
            root = Path(agent.env.get("TORCHELASTIC_ERROR_FILE", agent_dir / "root_cause.json"))
            output = agent_dir / "output.txt"
            runs.append(AgentRun(
                agent=agent,
                returncode=None if agent.name in stopped else group.returncode(by_agent[agent.name]),
                output=output.read_text(errors="replace") if output.exists() else "",
                seconds=elapsed,
                launch_id=group.launch_id,
                error_files=_read_error_files(agent_dir / "logs"),
                root_cause=json.loads(root.read_text()) if root.exists() else None,
            ))
    if stopped and raise_on_timeout and group.first_failure is None:
        tails = "\n".join(f"--- {r.agent.name} ---\n" + "\n".join(r.lines()[-15:]) for r in runs)
        raise TorchrunTimeout(f"agents {sorted(stopped)} did not finish within {timeout:g} s "
                              f"and were stopped\n{tails}", group.launch_id)
    return runs


def run_torchrun(torchrun_args: Sequence[str], module: str, module_args: Sequence[str] = (),
                 timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> AgentRun:
    """One torchrun agent (e.g. ``["--standalone", "--nproc-per-node=2"]``), bounded in time."""
    agent = Agent("agent", tuple(torchrun_args), module, tuple(module_args))
    return run_agents([agent], timeout=timeout, env=env)[0]


def node_devices(node: int, nproc_per_node: int) -> dict[str, str]:
    """Environment for simulated node ``node``: its own GPUs, or the CPU for everyone.

    Two "nodes" on one machine must not share a GPU: NCCL refuses two ranks on
    one device. With enough GPUs each node sees only its own slice
    (``CUDA_VISIBLE_DEVICES``, as you would set on a real shared machine);
    with fewer, the demonstration uses gloo on the CPU.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2 * nproc_per_node:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        mine = ids[node * nproc_per_node:(node + 1) * nproc_per_node]
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
    return {"DDPGUIDE_BACKEND": "gloo", "DDPGUIDE_DEVICE": "cpu"} if gpus else {}
