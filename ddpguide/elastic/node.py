"""``node`` and ``store`` modes: one torchrun agent per machine, and an optional separate store.

``node`` runs torchrun's own agent in this process, with input that
:mod:`ddpguide.elastic.checks` has checked (one line and exit code 2 for
anything wrong, before anything is started or written): torchrun's argument
parser and ``LaunchConfig``, launched with
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` itself
calls), with the package's tuned rendezvous settings, the store-sharing
workaround and workers forked from a warm forkserver. The source's two-machine
run becomes, on every machine::

    python -m ddpguide.elastic node --nnodes 1:3 --nproc-per-node 4 \\
        --rdzv-endpoint 192.0.0.1:1234 --rdzv-id 1 --max-restarts 3 \\
        --checkpoint /shared/checkpoint.pt --epochs 100

``store`` hosts the c10d rendezvous store as a process of its own, so that no
training node is a single point of failure (agents then pass ``is_host=false``).
"""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from ddpguide.core.commands import one_line
from ddpguide.core.processes import DIE_WITH_PARENT_ENV, die_with_parent
from ddpguide.elastic.checks import NodeOptions, StoreOptions
from ddpguide.elastic.settings import AgentSettings
from ddpguide.elastic.worker_args import STRATEGIES, WorkerArgs


def command_line(settings: AgentSettings, worker: WorkerArgs) -> str:
    """The equivalent plain ``torchrun`` command, for the reader to copy."""
    env = " ".join(f"{k}={v}" for k, v in settings.environment().items())
    parts = [env, "torchrun", *settings.torchrun_args(), "-m", "ddpguide.elastic.worker",
             *map(shlex.quote, worker.argv())]
    return " ".join(p for p in parts if p)


def run_node(options: NodeOptions) -> int:
    """Become this machine's torchrun agent; returns torchrun's exit code."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()  # started by a local demo: never outlive it
    settings, worker = options.agent, options.worker
    os.environ.update(settings.environment())
    os.environ["DDPGUIDE_NODE"] = options.node_name
    if settings.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does, before anything forks
    if options.warm:
        _start_forkserver(worker.strategy)
        _plain_agent_logging()
    argv = [*settings.torchrun_args(), "--start-method", "forkserver" if options.warm else "spawn",
            "-m", "ddpguide.elastic.worker", *worker.argv()]
    print("the same agent as a plain command (workers exec'd instead of forked):\n  "
          + command_line(settings, worker), file=sys.stderr, flush=True)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # torchrun's own parser and LaunchConfig: the agent is exactly torchrun's.
    config, command, command_args = config_from_args(get_args_parser().parse_args(argv))
    if options.warm:
        from ddpguide.elastic.worker import elastic_entry

        # A Python function as entrypoint makes the agent start workers with
        # multiprocessing (here: forked from the warm forkserver) instead of
        # exec'ing a fresh interpreter that must import torch again.
        command, command_args = elastic_entry, worker.argv()
    if options.start_when:
        _wait_for_go(options, options.start_when)
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


#: what the agent's forkserver imports once for every worker (DDP's constructor imports
#: torch._dynamo)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "ddpguide.elastic.worker", "ddpguide.train.loop")


def _start_forkserver(strategy: str) -> None:
    """Start multiprocessing's forkserver now (:func:`ddpguide.launch.warm.start`), importing
    torch and the worker in it: every worker (re)start is then a fork of a process that
    has paid for ``import torch`` and for the ``torch._dynamo`` import that DDP's
    constructor triggers (and, for ``fsdp``, for FSDP2 and distributed checkpointing).
    The server checks that it is single-threaded, so forking it is safe, and dies with
    the agent."""
    from ddpguide.launch import warm

    warm.start(preload=(*PRELOAD, *STRATEGIES[strategy].preload))


def _failure_text(exc) -> str:
    """The root cause of a failed worker group, on one line."""
    _, failure = exc.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    return one_line(message, 300) or f"exit code {failure.exitcode}"


def _wait_for_go(options: NodeOptions, start_when: str) -> None:
    """Hold a fully imported agent until the file ``start_when`` exists (``--start-when``: a demo's join on cue)."""
    import time

    from ddpguide.elastic.events import EventWriter

    if options.worker.events:
        EventWriter(options.worker.events, node=options.node_name,
                    rank=None).write("agent_waiting")
    while not Path(start_when).exists():
        time.sleep(0.02)


def run_store(options: StoreOptions) -> int:
    """Host a c10d TCPStore until SIGTERM/SIGINT (the rendezvous lives here, not in a node)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()
    import torch.distributed as dist

    store = dist.TCPStore(options.host, options.port, is_master=True, wait_for_workers=False,
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
