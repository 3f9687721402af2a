"""``python -m ddpguide.cluster up|run|down|list``: a cluster of namespaces on this machine.

* ``up --nodes 2 --ranks-per-node 2 --link 1gbit [--slow-node 1 --slow-link 100mbit]
  [--hold S]`` makes the cluster, prints its table and holds it until Ctrl-C,
  ``down`` or ``--hold`` seconds (default one hour); then removes it.
* ``run NODE [--cluster ID] [--timeout S] -- CMD ...`` runs CMD inside node NODE,
  with ``GLOO_SOCKET_IFNAME`` set to the node's interface.
* ``down [--cluster ID]`` removes a cluster (asking its driver first), and any
  that a dead driver left.
* ``list`` prints the live clusters.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from types import FrameType

from ddpguide.cluster import netns
from ddpguide.cluster.cluster import chosen, live_clusters, up
from ddpguide.cluster.spec import Spec
from ddpguide.core.commands import InputError, OneLineParser, integer, positive_float

PROG = "python -m ddpguide.cluster"
MAX_HOLD = 24 * 3600.0


def parser() -> OneLineParser:
    top = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    make = sub.add_parser("up", help="make a cluster and hold it")
    make.add_argument("--nodes", type=integer(2, 8), default=2)
    make.add_argument("--ranks-per-node", type=integer(1, 8), default=2)
    make.add_argument("--link", default="1gbit", help="every node's link rate (tc units)")
    make.add_argument("--slow-node", type=integer(0, 7), default=None)
    make.add_argument("--slow-link", default=None, help="the slow node's link rate")
    make.add_argument("--hold", type=positive_float(MAX_HOLD), default=3600.0,
                      help="seconds to hold the cluster before removing it")
    run = sub.add_parser("run", help="run a command on a node")
    run.add_argument("node", help="node0, node1, ... (or 0, 1, ...)")
    run.add_argument("--cluster", default=None, help="run id (default: the one started here)")
    run.add_argument("--timeout", type=positive_float(MAX_HOLD), default=600.0)
    run.add_argument("cmd", nargs="+", help="the command, after --")
    down = sub.add_parser("down", help="remove a cluster")
    down.add_argument("--cluster", default=None, help="run id (default: the one started here)")
    sub.add_parser("list", help="the live clusters")
    return top


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)  # one line, exit 2
    return 2


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_up(args: object) -> int:
    try:
        spec = Spec(args.nodes, args.ranks_per_node, args.link,  # type: ignore[attr-defined]
                    args.slow_node, args.slow_link)  # type: ignore[attr-defined]
    except InputError as exc:
        return fail(str(exc))
    missing = netns.missing_prerequisite()
    if missing:
        return fail(missing)
    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then keeps
    # it ignored, so `kill -INT` of a held cluster would leave it up until --hold ends
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    run_id = "?"
    try:
        with up(spec, holder="command") as cluster:
            run_id = cluster.run_id
            print(cluster.table(), flush=True)
            print(f"holding for {args.hold:g} s: Ctrl-C or `{PROG} down` "  # type: ignore[attr-defined]
                  "removes it", flush=True)
            deadline = time.monotonic() + args.hold  # type: ignore[attr-defined]
            while time.monotonic() < deadline:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    print(f"cluster {run_id} removed", flush=True)
    return 0


def cmd_run(args: object) -> int:
    try:
        cluster = chosen(args.cluster)  # type: ignore[attr-defined]
        node = cluster.node(args.node)  # type: ignore[attr-defined]
    except (LookupError, KeyError) as exc:
        return fail(str(exc).strip("'\""))
    [done] = cluster.run([(node, args.cmd)], args.timeout, capture=False)  # type: ignore[attr-defined]
    if done.returncode is None:
        print(f"{PROG}: stopped after {args.timeout:g} s", file=sys.stderr)  # type: ignore[attr-defined]
        return 124
    return done.returncode


def cmd_down(args: object) -> int:
    try:
        cluster = chosen(args.cluster)  # type: ignore[attr-defined]
    except LookupError as exc:
        removed = netns.remove_dead()
        if args.cluster is None and removed:  # type: ignore[attr-defined]
            print(f"removed what dead drivers left: {', '.join(removed)}")
            return 0
        return fail(str(exc))
    record = netns.read_records()[cluster.run_id]
    if record.get("holder") != "command":
        return fail(f"cluster {cluster.run_id} is held by a program (pid {record['driver_pid']}) "
                    "that removes it when its `with` block ends")
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(record["driver_pid"]), signal.SIGTERM)  # type: ignore[call-overload]
    netns.wait_for_exit([int(record["driver_pid"])], 15.0)  # type: ignore[call-overload]
    if netns.record_path(cluster.run_id).exists():
        netns.destroy(cluster.run_id)
    netns.remove_dead()
    print(f"cluster {cluster.run_id} removed")
    return 0


def cmd_list(args: object) -> int:
    for cluster in live_clusters():
        print(cluster.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    return {"up": cmd_up, "run": cmd_run, "down": cmd_down, "list": cmd_list}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
