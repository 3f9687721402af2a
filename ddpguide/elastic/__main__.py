"""``python -m ddpguide.elastic [demo|node|store] ...`` (no arguments: the local demo)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddpguide.elastic.settings import (
    TUNED_MONITOR_INTERVAL,
    TUNED_RDZV_CONF,
    UsageError,
)

SECURITY = ("The c10d rendezvous store and the workers' store listen on every network "
            "interface and have no authentication: run this on trusted networks only.")
MODES = ("demo", "node", "store")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (and exit code 2, as argparse does)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    conf = ",".join(f"{k}={v}" for k, v in TUNED_RDZV_CONF.items())
    top = _Parser(prog="python -m ddpguide.elastic",
                  description="Elastic training with torchrun. Without arguments: the local demo "
                              "(node A starts, node B joins, B leaves, a worker is killed).",
                  epilog=SECURITY)
    sub = top.add_subparsers(dest="mode", parser_class=_Parser)

    demo = sub.add_parser("demo", help="the local demo on 127.0.0.1 (the default)",
                          description="Two torchrun agents on this machine: join, leave, crash.",
                          epilog=SECURITY)
    demo.add_argument("--report", metavar="FILE.json", help="write the timeline as JSON")
    demo.add_argument("--workdir", help="keep checkpoint, events and node logs here "
                                        "(an empty or new directory; default: a temporary one)")
    demo.add_argument("--epochs", type=int, default=14)
    demo.add_argument("--step-delay", type=float, default=0.15,
                      help="seconds of sleep per step, standing in for compute (default 0.15)")
    demo.add_argument("--external-store", action="store_true",
                      help="host the rendezvous store in a separate process")
    demo.add_argument("--torchrun-defaults", action="store_true",
                      help="torchrun's rendezvous timings instead of the tuned ones (slow)")

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
    node.add_argument("--checkpoint", required=True, help="checkpoint path every machine can reach")
    node.add_argument("--epochs", type=int, default=12)
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
    node.add_argument("--events", help="append JSON-lines events to this file")
    node.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demo pacing)")
    node.add_argument("--samples", type=int, default=256, help="training samples")
    node.add_argument("--batch-size", type=int, default=16, help="per worker")
    node.add_argument("--worker-timeout", type=float, default=30.0,
                      help="seconds before a collective gives up")
    node.add_argument("--worker-start", choices=("forkserver", "exec"), default="forkserver",
                      help="forkserver (default): fork workers from a process that has imported "
                           "torch already; exec: a fresh interpreter per worker, as plain torchrun")
    node.add_argument("--start-when", metavar="FILE",
                      help="import everything, then wait until FILE exists before joining "
                           "(a demo starts an agent ahead and lets it join on cue)")

    store = sub.add_parser("store", help="host the rendezvous store as its own process",
                           description="Host the c10d store so that no training node is a single "
                                       "point of failure.", epilog=SECURITY)
    store.add_argument("--port", type=int, required=True)
    store.add_argument("--host", default="127.0.0.1", help="address clients use (informational)")
    return top


def _check_demo(args) -> None:
    if args.epochs < 8:
        raise UsageError(f"--epochs {args.epochs}: the demo needs at least 8 epochs")
    if args.step_delay < 0:
        raise UsageError(f"--step-delay {args.step_delay}: must be >= 0")
    if args.workdir:
        workdir = Path(args.workdir)
        if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
            raise UsageError(f"--workdir {workdir}: must be a new or empty directory")
    if args.report:
        folder = Path(args.report).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UsageError(f"--report {args.report}: directory {folder} is not writable")


def _demo(args) -> int:
    from ddpguide.elastic.demo import DemoError, DemoSettings, run_demo
    from ddpguide.elastic.report import summary

    _check_demo(args)
    settings = DemoSettings(epochs=args.epochs, step_delay=args.step_delay,
                            external_store=args.external_store,
                            torchrun_defaults=args.torchrun_defaults,
                            # torchrun's defaults wait up to 45 s for a lost node
                            phase_timeout_s=150.0 if args.torchrun_defaults else 60.0)
    print("elastic demo: torchrun agents on 127.0.0.1 (Ctrl-C stops everything)", flush=True)
    try:
        report = run_demo(args.workdir, settings, args.report,
                          echo=lambda line: print(line, flush=True))
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
    try:
        if args.mode == "demo":
            return _demo(args)
        if args.mode == "node":
            from ddpguide.elastic.node import run_node

            return run_node(args)
        from ddpguide.elastic.node import run_store

        return run_store(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
