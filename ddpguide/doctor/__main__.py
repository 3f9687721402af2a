"""``python -m ddpguide.doctor [--timeout S] [--sizes LIST] [--nproc N] [--json FILE]``.

Under a launcher (``RANK`` set) this process is one rank; without one it
starts a local group (see :mod:`ddpguide.doctor.local`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from ddpguide.doctor.options import options_or_exit


def main(argv: list[str] | None = None) -> int:
    """Check the options, then run as one rank or as the parent of a local group."""
    options = options_or_exit(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:
        from ddpguide.doctor.worker import run_rank
        return run_rank(options)
    tasks = os.environ.get("SLURM_NTASKS", "1")
    if tasks.isdigit() and int(tasks) > 1:
        # One local group per srun task would test nothing about the job: say how to run it.
        print(f"PROBLEM rank ? (host {socket.gethostname()}): srun task "
              f"{os.environ.get('SLURM_PROCID', '?')} of {tasks} has no RANK: run the doctor under "
              "torchrun in the job (as cluster/slurm_torchrun.sbatch runs training), or export "
              "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each task", flush=True)
        return 1
    from ddpguide.doctor.local import run_local
    return run_local(options)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 2
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Skip interpreter teardown: gloo's threads occasionally abort it after a clean run.
    os._exit(code)
