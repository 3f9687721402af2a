"""``node`` and ``store`` modes: one torchrun agent per machine, and an optional separate store.

``node`` checks its input (one line and exit code 2 for anything wrong,
before anything is started or written), then runs torchrun's own agent in
this process: torchrun's argument parser and ``LaunchConfig``, launched with
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` itself
calls), with the package's tuned rendezvous settings, the store-sharing
workaround and workers forked from a warm forkserver. The seed's two-machine
run becomes, on every machine::

    python -m ddpguide.elastic node --nnodes 1:3 --nproc-per-node 4 \\
        --rdzv-endpoint 192.0.0.1:1234 --rdzv-id 1 --max-restarts 3 \\
        --checkpoint /shared/checkpoint.pt --epochs 100

``store`` hosts the c10d rendezvous store as a process of its own, so that no
training node is a single point of failure (agents then pass ``is_host=false``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from ddpguide.core.processes import DIE_WITH_PARENT_ENV, die_with_parent
from ddpguide.elastic.settings import (
    TORCHRUN_MONITOR_INTERVAL,
    TORCHRUN_RDZV_CONF,
    AgentSettings,
    UsageError,
    command_line,
    is_local_host,
    parse_endpoint,
    parse_rdzv_conf,
    port_is_free,
)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (c10d prints C++ retry warnings while probing)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def store_answers(host: str, port: int, wait_s: float = 3.0) -> bool:
    """True when a c10d TCPStore answers at host:port within ``wait_s``.

    A TCPStore client talking to some other server can hang past its own
    timeout, so the probe runs in a daemon thread that is abandoned if late.
    """
    import torch.distributed as dist

    answers: list[bool] = []

    def probe() -> None:
        with contextlib.suppress(Exception):
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=wait_s))
            store.check(["ddpguide-probe"])
            answers.append(True)

    with _quiet_stderr():
        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        thread.join(wait_s)
    return bool(answers)


def check_endpoint(settings: AgentSettings) -> None:
    """Refuse an endpoint whose port on this machine is held by something that is not a store."""
    host, port = parse_endpoint(settings.rdzv_endpoint)
    # Only a connection tells: binding the port to test it would hold it for a
    # moment, and an agent starting beside this one could then fail to bind its
    # store there and quietly become a client of a store that never comes.
    if not is_local_host(host) or not _listening(host, port):
        return  # a remote store, or one this agent will host
    if not store_answers(host, port):
        raise UsageError(f"--rdzv-endpoint {settings.rdzv_endpoint}: port {port} is in use "
                         "by another program, not a c10d store; pick a free port")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return False
    return True


def check_checkpoint(path: str) -> None:
    """A checkpoint path must be writable, and an existing checkpoint must fit the model."""
    from ddpguide.core.checkpoint import (
        CheckpointError,
        check_checkpoint_fits,
        check_writable_directory,
    )
    from ddpguide.core.models import ToyModel

    try:
        check_writable_directory(path)
        with _warnings_as_notes():
            check_checkpoint_fits(path, ToyModel())
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint {path}: {exc}") from None


@contextlib.contextmanager
def _warnings_as_notes():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)


def build_settings(args) -> AgentSettings:
    """AgentSettings from parsed ``node`` arguments (tuned unless --torchrun-defaults)."""
    if args.torchrun_defaults:
        conf = {k: str(v) for k, v in TORCHRUN_RDZV_CONF.items()}
        monitor = TORCHRUN_MONITOR_INTERVAL
    else:
        conf = AgentSettings().rdzv_conf
        monitor = AgentSettings().monitor_interval
    conf.update(parse_rdzv_conf(args.rdzv_conf))
    if args.external_store:
        conf["is_host"] = "false"
    return AgentSettings(
        nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval if args.monitor_interval is not None else monitor,
        rdzv_conf=conf, local_addr=args.local_addr, share_store=args.share_store,
    ).validate()


def worker_args(args) -> list[str]:
    """The worker half of the command line."""
    out = ["--checkpoint", str(Path(args.checkpoint).resolve()), "--epochs", str(args.epochs),
           "--step-delay", f"{args.step_delay:g}", "--samples", str(args.samples),
           "--batch-size", str(args.batch_size), "--timeout", f"{args.worker_timeout:g}"]
    if args.events:
        out += ["--events", str(Path(args.events).resolve())]
    return out


def run_node(args) -> int:
    """Validate, then become this machine's torchrun agent; returns torchrun's exit code."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()  # started by a local demo: never outlive it
    settings = build_settings(args)
    if args.epochs < 1:
        raise UsageError(f"--epochs {args.epochs}: must be at least 1")
    if args.step_delay < 0:
        raise UsageError(f"--step-delay {args.step_delay}: must be >= 0")
    check_checkpoint(args.checkpoint)
    if settings.rdzv_conf.get("is_host", "").lower() not in ("false", "0"):
        check_endpoint(settings)
    if args.events:
        events_dir = Path(args.events).resolve().parent
        if not events_dir.is_dir() or not os.access(events_dir, os.W_OK):
            raise UsageError(f"--events {args.events}: directory {events_dir} is not writable")

    os.environ.update(settings.environment())
    if args.node_name:
        os.environ["DDPGUIDE_NODE"] = args.node_name
    warm = args.worker_start == "forkserver" and not args.torchrun_defaults
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does, before anything forks
    if warm:
        _start_forkserver()
        _plain_agent_logging()
    argv = [*settings.torchrun_args(), "--start-method", "forkserver" if warm else "spawn",
            "-m", "ddpguide.elastic.worker", *worker_args(args)]
    print("the same agent as a plain command (workers exec'd instead of forked):\n  "
          + command_line(settings, worker_args(args)), file=sys.stderr, flush=True)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # torchrun's own parser and LaunchConfig: the agent is exactly torchrun's.
    config, command, command_args = config_from_args(get_args_parser().parse_args(argv))
    if warm:
        from ddpguide.elastic.worker import elastic_entry

        # A Python function as entrypoint makes the agent start workers with
        # multiprocessing (here: forked from the warm forkserver) instead of
        # exec'ing a fresh interpreter that must import torch again.
        command, command_args = elastic_entry, worker_args(args)
    if args.start_when:
        _wait_for_go(args)
    try:
        elastic_launch(config, command)(*command_args)
    except ChildFailedError as exc:
        print(f"error: the worker group failed for good: {_failure_text(exc)}", file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"node stopped by signal {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def _plain_agent_logging() -> None:
    """Format the agent's log records with plain ``logging``.

    torch's own log formatter imports ``torch._dynamo`` the first time it
    formats an exception, which is exactly when a worker has just failed: the
    agent then spends seconds importing a compiler before it restarts the
    group (measured: 4-8 s on a busy 2-core machine).
    """
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s", "%H:%M:%S"))
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver now, importing torch and the worker in it.

    The forkserver is single-threaded, so forking it is safe; every worker
    (re)start is then a fork of a process that has paid for ``import torch``
    and for the ``torch._dynamo`` import that DDP's constructor triggers.
    """
    import multiprocessing
    from multiprocessing import forkserver

    os.environ["DDPGUIDE_AGENT_PID"] = str(os.getpid())  # see ddpguide.elastic.warm
    multiprocessing.set_forkserver_preload(["ddpguide.elastic.warm"])
    forkserver.ensure_running()


def _failure_text(exc) -> str:
    """The root cause of a failed worker group, on one line."""
    _, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    return " ".join(str(message).split())[:300] or f"exit code {failure.exitcode}"


def _wait_for_go(args) -> None:
    """Hold a fully imported agent until ``--start-when`` exists (a demo's join on cue)."""
    import time

    from ddpguide.elastic.events import EventWriter

    if args.events:
        EventWriter(args.events, node=args.node_name, rank=None).write("agent_waiting")
    while not Path(args.start_when).exists():
        time.sleep(0.02)


def run_store(args) -> int:
    """Host a c10d TCPStore until SIGTERM/SIGINT (the rendezvous lives here, not in a node)."""
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: outside 1-65535")
    if not port_is_free(args.host, args.port):
        raise UsageError(f"--port {args.port}: already in use on this machine")
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()
    import torch.distributed as dist

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          multi_tenant=True, timeout=datetime.timedelta(seconds=60))
    print(f"c10d store listening on port {store.port} (every interface, no authentication: "
          "trusted networks only); start nodes with --external-store "
          f"--rdzv-endpoint <this host>:{store.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del store
    return 0
