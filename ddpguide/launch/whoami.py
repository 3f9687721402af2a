"""A worker that says who it is: what its launcher put into its environment.

Run it under any launcher and every worker reports one JSON record::

    torchrun --standalone --nproc-per-node=2 -m ddpguide.launch.whoami --out /tmp/who

The record holds the variables torchrun sets (RANK, LOCAL_RANK, GROUP_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, OMP_NUM_THREADS, ...), the worker's process ids,
and what the process group itself says once the worker has joined it: its rank
and size, and the sum of an all-reduce over every worker (which only comes out
right when all of them really are in one group).

With ``--out DIR`` each worker writes ``DIR/rank<RANK>.json`` (one file per
worker, so no two processes write to the same file); without it, each prints
one line ``WHOAMI {...}`` to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any, Mapping

from ddpguide.core.processes import exit_now
from ddpguide.core.runtime import LAUNCHER_VARIABLES

#: Set by :mod:`ddpguide.train.torchrun_demo` on each agent so workers can name their node.
NODE_NAME_VARIABLE = "DDPGUIDE_NODE_NAME"
RECORD_PREFIX = "WHOAMI "


def environment_record(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launcher's variables (None where unset), with pids and the host name."""
    environ = os.environ if environ is None else environ
    record: dict[str, Any] = {name: environ.get(name) for name in LAUNCHER_VARIABLES}
    record.update(
        node_name=environ.get(NODE_NAME_VARIABLE),
        pid=os.getpid(),
        parent_pid=os.getppid(),  # the torchrun agent that started this worker
        hostname=socket.gethostname(),
    )
    return record


def group_record(timeout_s: float) -> dict[str, Any]:
    """Join the process group, ask it who we are, and prove it is complete."""
    import torch
    import torch.distributed as dist

    from ddpguide.core import process_group

    env, runtime = process_group.setup(timeout_s=timeout_s)
    try:
        one = torch.ones(1, device=runtime.device(env.local_rank))
        dist.all_reduce(one)
        return {
            "group_rank_of_process": dist.get_rank(),
            "group_size": dist.get_world_size(),
            "all_reduce_of_ones": int(one.item()),
            "backend": runtime.backend,
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        process_group.cleanup()


def report(out_dir: str | None, join_group: bool = True, timeout_s: float = 60.0) -> dict[str, Any]:
    """Build this worker's record and write it to ``out_dir`` (or print it)."""
    record = environment_record()
    if join_group:
        record.update(group_record(timeout_s))
    if out_dir:
        directory = Path(out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{record['RANK'] if record['RANK'] is not None else 'none'}.json"
        partial = directory / f".{name}.{os.getpid()}.part"
        partial.write_text(json.dumps(record))
        os.replace(partial, directory / name)  # readers never see half a record
    else:
        # one write: the record and its newline must not be split by another rank's output
        sys.stdout.write(RECORD_PREFIX + json.dumps(record) + "\n")
        sys.stdout.flush()
    return record


def read_records(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record written to ``out_dir``, sorted by global rank."""
    records = [json.loads(p.read_text()) for p in Path(out_dir).glob("rank*.json")]
    return sorted(records, key=lambda r: int(r["RANK"]) if r["RANK"] is not None else -1)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m ddpguide.launch.whoami [--out DIR] [--no-group]``."""
    parser = argparse.ArgumentParser(prog="python -m ddpguide.launch.whoami", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", help="write DIR/rank<RANK>.json instead of printing")
    parser.add_argument("--no-group", action="store_true",
                        help="only report the environment; do not join a process group")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds before joining or the all-reduce gives up (default 60)")
    args = parser.parse_args(argv)
    join = not args.no_group and "WORLD_SIZE" in os.environ
    report(args.out, join_group=join, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    exit_now(main())
