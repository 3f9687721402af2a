"""Run the chapter's standalone programs with torchrun, bounded in time, and read their checks.

The programs (``book/programs/tensor_parallel.py``, ``fsdp_tp_2d.py``,
``dcp_reshard.py``) import only torch. A chapter cell or a test runs one as a
reader would type it, ``torchrun --standalone --nproc-per-node=N program.py``,
through :func:`ddpguide.torchrun_agents.run_agents`: every process of the launch
is stopped at the time limit, workers included.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ddpguide.launch.torchrun import Agent, AgentRun, run_agents

#: torchrun's own log lines: ``W1201 04:53:33.603000 6362 torch/distributed/run.py:982] ...``
#: on a terminal, and its OMP_NUM_THREADS notice, which comes without that prefix otherwise.
_TORCHRUN_LOG = re.compile(r"^(?:[DIWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]|Setting OMP_NUM_THREADS )")


@dataclass
class ProgramRun:
    """One launch of a program: the command a reader types, and what came back."""

    command: str
    run: AgentRun

    @property
    def returncode(self) -> int | None:
        return self.run.returncode

    def lines(self) -> list[str]:
        """What the program printed, without torchrun's own log lines."""
        return [line for line in self.run.lines() if not _TORCHRUN_LOG.match(line)]

    def checks(self) -> list[str]:
        """The lines that report a check (``check: ... OK`` or ``... FAILED``)."""
        return [line.strip() for line in self.lines() if line.strip().startswith("check:")]

    def text(self) -> str:
        return "\n".join([f"$ {self.command}", *self.lines(), f"(exit status {self.returncode}, "
                          f"{self.run.seconds:.1f} s)"])


def run_program(program: str | Path, nproc: int, args: Sequence[str] = (),
                timeout: float = 180.0) -> ProgramRun:
    """``torchrun --standalone --nproc-per-node=nproc program args``, at most ``timeout`` s.

    ``program`` is a path as the reader would type it (relative to the current
    directory). Raises ``ValueError`` if it is not a file, and
    :class:`ddpguide.torchrun_agents.TorchrunTimeout` after stopping everything.
    """
    if not Path(program).is_file():
        raise ValueError(f"program {str(program)!r} is not a file")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    options = ("--standalone", f"--nproc-per-node={nproc}")
    # --no-python with this interpreter is what torchrun does for a script, with the
    # interpreter named (the agent's own `python` might be another one).
    agent = Agent(Path(program).stem, options, sys.executable, (str(program), *args), no_python=True)
    command = shlex.join(["torchrun", *options, str(program), *args])
    return ProgramRun(command, run_agents([agent], timeout=timeout)[0])
