"""Without a launcher: start a local group of ranks, each running the doctor, bounded in time.

The ranks are plain subprocesses given the variables a launcher would set
(:func:`ddpguide.core.runtime.launcher_environment`: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, a free ``MASTER_PORT``, ...), so they take exactly
the path they take under torchrun or SLURM. Their output is echoed line by line.
"""

from __future__ import annotations

import os
import sys

from ddpguide.core.processes import ephemeral_port as free_port
from ddpguide.core.runtime import launcher_environment
from ddpguide.doctor import LOCAL_LAUNCH_VARIABLE
from ddpguide.doctor.options import Options, watchdog_limit_s
from ddpguide.launch import ranks
from ddpguide.launch.torchrun import agent_environment

HOST = "127.0.0.1"
#: Once rank 0 has printed the report and exited, the others get this long before they are stopped.
AFTER_RANK_0_S = 5.0


def run_local(options: Options) -> int:
    """Start ``options.nproc`` ranks on 127.0.0.1 and return the group's exit status."""
    port = free_port(HOST)
    print(f"ddpguide doctor: no launcher variables (RANK is unset): starting a local group "
          f"of {options.nproc} rank(s) on {HOST}:{port}", flush=True)
    command = [sys.executable, "-m", "ddpguide.doctor", *options.rank_argv()]
    # Each rank ends itself by then; this only guards against a rank that cannot.
    limit = watchdog_limit_s(options) + 30.0
    with ranks.Ranks(echo=lambda text: print(text, end="", flush=True)) as group:
        for rank in range(options.nproc):
            group.start(ranks.Command(command, base_env=agent_environment({
                **launcher_environment(rank, options.nproc, port, addr=HOST),
                LOCAL_LAUNCH_VARIABLE: "1"})))
        # rank 0 reported: a stopped rank is not waited for
        outcome = group.wait(limit, until=lambda: not group.alive(0), all_end=True)
        if outcome is ranks.Outcome.UNTIL:
            group.wait(AFTER_RANK_0_S, all_end=True)
        stuck = [rank for rank in range(options.nproc) if group.alive(rank)]
        rank0_running = group.alive(0)
        group.stop(grace=0.0)
        codes = group.returncodes()
    if stuck and rank0_running:
        print(f"PROBLEM ranks {stuck} (host {os.uname().nodename}): still running after "
              f"{limit:g} s and were stopped", flush=True)
        return 1
    return codes[0] if codes[0] else next((code for code in codes if code), 0)
