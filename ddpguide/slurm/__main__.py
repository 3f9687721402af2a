"""``python -m ddpguide.slurm up|run|down|list``: Slurm on a cluster of namespaces.

* ``up --nodes 2 [--cpus 2] [--link 1gbit] [--hold S]`` makes the cluster of
  chapter 15, starts ``slurmctld`` on node 0 and a ``slurmd`` on every node,
  prints the cluster and holds it until Ctrl-C, ``down`` or ``--hold`` seconds
  (default one hour); then stops every daemon and removes it.
* ``run [--cluster ID] [--timeout S] -- CMD ...`` runs CMD (``sinfo``,
  ``sbatch job.sbatch``, ``srun -N2 hostname``, ``squeue``, ``scontrol show job 1``)
  on node 0, with ``SLURM_CONF`` naming the cluster's configuration.
* ``down [--cluster ID]`` removes a Slurm cluster (asking its driver first), and
  whatever dead drivers left.
* ``list`` prints the live Slurm clusters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from ddpguide.cluster import netns
from ddpguide.cluster.__main__ import MAX_HOLD, _interrupt
from ddpguide.cluster.spec import Spec
from ddpguide.core.commands import InputError, OneLineParser, integer, positive_float
from ddpguide.slurm import scheduler
from ddpguide.slurm.config import missing_prerequisite

PROG = "python -m ddpguide.slurm"
READY = "slurm ready"


def parser() -> OneLineParser:
    top = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    make = sub.add_parser("up", help="make a Slurm cluster and hold it")
    make.add_argument("--nodes", type=integer(2, 8), default=2)
    make.add_argument("--cpus", type=integer(1, 64), default=2, help="CPUs of each node")
    make.add_argument("--link", default="1gbit", help="every node's link rate (tc units)")
    make.add_argument("--hold", type=positive_float(MAX_HOLD), default=3600.0,
                      help="seconds to hold the cluster before removing it")
    which = {"default": None, "help": "run id (default: the only live one)"}
    run = sub.add_parser("run", help="run a Slurm command on node 0")
    run.add_argument("--cluster", **which)  # type: ignore[arg-type]
    run.add_argument("--timeout", type=positive_float(MAX_HOLD), default=600.0)
    run.add_argument("cmd", nargs="+", help="the command, after --")
    sub.add_parser("down", help="remove a Slurm cluster").add_argument("--cluster", **which)  # type: ignore[arg-type]
    sub.add_parser("list", help="the live Slurm clusters")
    return top


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)  # one line, exit 2
    return 2


def chosen(run_id: str | None) -> scheduler.Slurm:
    """Slurm cluster ``run_id``, else the only live one; LookupError with the reason."""
    clusters = scheduler.live()
    names = ", ".join(sorted(clusters)) or "none"
    if run_id is not None:
        if run_id not in clusters:
            raise LookupError(f"argument --cluster: no live Slurm cluster {run_id!r} (live: {names})")
        return clusters[run_id]
    if len(clusters) != 1:
        raise LookupError(f"{len(clusters)} live Slurm clusters: name one with --cluster ID "
                          f"(live: {names})")
    return next(iter(clusters.values()))


def cmd_up(args: object) -> int:
    try:
        spec = Spec(args.nodes, 1, args.link)  # type: ignore[attr-defined]
    except InputError as exc:
        return fail(str(exc))
    missing = missing_prerequisite()
    if missing:
        return fail(missing)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    run_id = "?"
    try:
        with scheduler.up(spec, cpus=args.cpus) as slurm:  # type: ignore[attr-defined]
            run_id = slurm.run_id
            print(slurm.table(), flush=True)
            print(f"{READY}: `{PROG} run -- sinfo`; held for {args.hold:g} s, "  # type: ignore[attr-defined]
                  f"Ctrl-C or `{PROG} down` removes it", flush=True)
            deadline = time.monotonic() + args.hold  # type: ignore[attr-defined]
            while time.monotonic() < deadline:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    print(f"slurm cluster {run_id} removed", flush=True)
    return 0


def cmd_run(args: object) -> int:
    try:
        slurm = chosen(args.cluster)  # type: ignore[attr-defined]
    except LookupError as exc:
        return fail(str(exc))
    code = slurm.run_through(args.cmd, args.timeout)  # type: ignore[attr-defined]
    if code is None:
        print(f"{PROG}: stopped after {args.timeout:g} s", file=sys.stderr)  # type: ignore[attr-defined]
        return 124
    return code


def cmd_down(args: object) -> int:
    try:
        slurm = chosen(args.cluster)  # type: ignore[attr-defined]
    except LookupError as exc:
        removed = scheduler.remove_dead() if missing_prerequisite() is None else []
        if removed and args.cluster in (None, *removed):  # type: ignore[attr-defined]
            print(f"removed what dead drivers left: {', '.join(removed)}")
            return 0
        return fail(str(exc))
    record = netns.read_records()[slurm.run_id]
    driver = int(record["driver_pid"])  # type: ignore[call-overload]
    with contextlib.suppress(ProcessLookupError):
        os.kill(driver, signal.SIGTERM)
    netns.wait_for_exit([driver], 60.0)  # the driver stops its daemons, then the namespaces
    scheduler.remove_dead()
    print(f"slurm cluster {slurm.run_id} removed")
    return 0


def cmd_list(args: object) -> int:
    for slurm in scheduler.live().values():
        print(slurm.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    return {"up": cmd_up, "run": cmd_run, "down": cmd_down, "list": cmd_list}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
