"""``python -m ddpguide.elastic [demo|node|store] ...`` (no arguments: the local demo)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from ddpguide.core.commands import OneLineParser
from ddpguide.elastic.demo import MIN_EPOCHS, DemoSettings
from ddpguide.elastic.settings import (
    TUNED_MONITOR_INTERVAL,
    TUNED_RDZV_CONF,
    UsageError,
)
from ddpguide.elastic.worker_args import STRATEGIES, WorkerArgs

if TYPE_CHECKING:
    from ddpguide.elastic.checks import DemoPlan

SECURITY = ("The c10d rendezvous store and the workers' store listen on every network "
            "interface and have no authentication: run this on trusted networks only.")
MODES = ("demo", "node", "store")


def _parser() -> argparse.ArgumentParser:
    conf = ",".join(f"{k}={v}" for k, v in TUNED_RDZV_CONF.items())
    top = OneLineParser(prog="python -m ddpguide.elastic",
                  description="Elastic training with torchrun. Without arguments: the local demo "
                              "(node A starts, node B joins, B leaves, a worker is killed).",
                  epilog=SECURITY)
    sub = top.add_subparsers(dest="mode", parser_class=OneLineParser)

    demo = sub.add_parser("demo", help="the local demo on 127.0.0.1 (the default)",
                          description="Two torchrun agents on this machine: join, leave, crash.",
                          epilog=SECURITY)
    demo.add_argument("--report", metavar="FILE.json", help="write the timeline as JSON")
    demo.add_argument("--workdir", help="keep checkpoint, events and node logs here "
                                        "(an empty or new directory; default: a temporary one)")
    demo.add_argument("--epochs", type=int, default=DemoSettings.epochs,
                      help=f"at least {MIN_EPOCHS} (default {DemoSettings.epochs})")
    demo.add_argument("--step-delay", type=float, default=DemoSettings.step_delay,
                      help="seconds of sleep per step, standing in for compute "
                           f"(default {DemoSettings.step_delay})")
    demo.add_argument("--external-store", action="store_true",
                      help="host the rendezvous store in a separate process")
    demo.add_argument("--torchrun-defaults", action="store_true",
                      help="torchrun's rendezvous timings instead of the tuned ones (slow)")
    demo.add_argument("--strategy", choices=tuple(STRATEGIES), default=DemoSettings.strategy,
                      help=f"how the workers train. {WorkerArgs.metadata('strategy')['help']} "
                           f"(default {DemoSettings.strategy})")

    node = sub.add_parser("node", help="this machine's torchrun agent (one per machine)",
                          description="Run one machine's torchrun agent with tuned rendezvous "
                                      "settings and the store-sharing workaround. The same "
                                      "command on every machine, e.g. --nnodes 1:3 "
                                      "--nproc-per-node 4 --rdzv-endpoint 192.0.0.1:1234 "
                                      "--rdzv-id 1 --checkpoint /shared/checkpoint.pt.",
                          epilog=SECURITY)
    node.add_argument("--nnodes", required=True, help="N or MIN:MAX, e.g. 1:3")
    node.add_argument("--nproc-per-node", type=int, required=True, help="workers on this machine")
    node.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT of the c10d store")
    node.add_argument("--rdzv-id", default="ddpguide", help="job id, the same on every machine")
    node.add_argument("--max-restarts", type=int, default=3,
                      help="worker-group restarts allowed for failures (joins are free)")
    node.add_argument("--rdzv-conf", default="",
                      help=f"KEY=VALUE,... over the defaults ({conf}); e.g. is_host=false")
    node.add_argument("--monitor-interval", type=float, default=None,
                      help=f"seconds between worker health checks (default {TUNED_MONITOR_INTERVAL})")
    node.add_argument("--torchrun-defaults", action="store_true",
                      help="torchrun's own rendezvous timings and exec'd workers (for comparison)")
    node.add_argument("--share-store", action="store_true",
                      help="do not apply TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (scale-up then hangs)")
    node.add_argument("--external-store", action="store_true",
                      help="the store runs elsewhere (python -m ddpguide.elastic store): is_host=false")
    node.add_argument("--local-addr", help="address other machines reach this one at")
    node.add_argument("--node-name", default=os.uname().nodename, help="name in the event file")
    node.add_argument("--worker-start", choices=("forkserver", "exec"), default="forkserver",
                      help="forkserver (default): fork workers from a process that has imported "
                           "torch already; exec: a fresh interpreter per worker, as plain torchrun")
    node.add_argument("--start-when", metavar="FILE",
                      help="import everything, then wait until FILE exists before joining "
                           "(a demo starts an agent ahead and lets it join on cue)")
    workers = node.add_argument_group("the workers' options (--checkpoint: a path every "
                                      "machine can reach)")
    WorkerArgs.add_arguments(workers, node=True)

    store = sub.add_parser("store", help="host the rendezvous store as its own process",
                           description="Host the c10d store so that no training node is a single "
                                       "point of failure.", epilog=SECURITY)
    store.add_argument("--port", type=int, required=True)
    store.add_argument("--host", default="127.0.0.1", help="address clients use (informational)")
    return top


def _demo(plan: DemoPlan) -> int:
    from ddpguide.elastic.demo import DemoError, run_demo
    from ddpguide.elastic.progress import EpochBar
    from ddpguide.elastic.report import summary

    choice = STRATEGIES[plan.settings.strategy]
    sharded = f" with {choice.title} workers and a sharded (DCP) checkpoint" if choice.sharded else ""
    print(f"elastic demo: torchrun agents on 127.0.0.1{sharded} (Ctrl-C stops everything)",
          flush=True)
    try:
        with EpochBar(plan.settings.epochs) as bar:  # on stderr, when it is a terminal
            report = run_demo(plan.workdir, plan.settings, plan.report, echo=bar.echo,
                              on_event=bar.event)
    except DemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary(report), flush=True)
    return 0 if report["finished"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in MODES and argv[0] not in ("-h", "--help")):
        argv.insert(0, "demo")
    args = _parser().parse_args(argv)
    from ddpguide.elastic import checks

    try:
        # Every input is checked before anything starts (UsageError: one line, exit 2).
        if args.mode == "demo":
            return _demo(checks.check_demo(args))
        if args.mode == "node":
            options = checks.check_node(args)
            from ddpguide.elastic.node import run_node

            return run_node(options)
        store = checks.check_store(args)
        from ddpguide.elastic.node import run_store

        return run_store(store)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
