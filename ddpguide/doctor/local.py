"""Without a launcher: start a local group of ranks, each running the doctor, bounded in time.

The ranks are plain subprocesses given the variables a launcher would set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, a free
``MASTER_PORT``, ...), so they take exactly the path they take under torchrun
or SLURM. Their output goes to this process's stdout and stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ddpguide.core.processes import ephemeral_port as free_port
from ddpguide.doctor import LOCAL_LAUNCH_VARIABLE
from ddpguide.doctor.options import Options, watchdog_limit_s
from ddpguide.launch.torchrun import agent_environment

HOST = "127.0.0.1"
#: Once rank 0 has printed the report and exited, the others get this long before they are stopped.
AFTER_RANK_0_S = 5.0


def rank_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What a launcher gives rank ``rank`` of ``nproc`` on this machine."""
    return agent_environment({
        "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port), LOCAL_LAUNCH_VARIABLE: "1",
    })


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


def run_local(options: Options) -> int:
    """Start ``options.nproc`` ranks on 127.0.0.1 and return the group's exit status."""
    port = free_port(HOST)
    print(f"ddpguide doctor: no launcher variables (RANK is unset): starting a local group "
          f"of {options.nproc} rank(s) on {HOST}:{port}", flush=True)
    command = [sys.executable, "-m", "ddpguide.doctor", *options.rank_argv()]
    processes: list[subprocess.Popen] = []
    # Each rank ends itself by then; this only guards against a rank that cannot.
    deadline = time.monotonic() + watchdog_limit_s(options) + 30.0
    try:
        for rank in range(options.nproc):
            processes.append(subprocess.Popen(command, env=rank_environment(rank, options.nproc, port),
                                              stdin=subprocess.DEVNULL))
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if processes[0].poll() is not None:  # rank 0 reported: a stopped rank is not waited for
                deadline = min(deadline, time.monotonic() + AFTER_RANK_0_S)
            time.sleep(0.05)
        stuck = [rank for rank, p in enumerate(processes) if p.poll() is None]
        if stuck and processes[0].poll() is None:
            print(f"PROBLEM ranks {stuck} (host {os.uname().nodename}): still running after "
                  f"{watchdog_limit_s(options) + 30:g} s and were stopped", flush=True)
            return 1
    finally:
        _stop(processes)
    codes = [p.returncode for p in processes]
    return codes[0] if codes[0] else next((code for code in codes if code), 0)
