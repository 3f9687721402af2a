"""Every input of ``python -m ddpguide.elastic`` is checked before anything starts.

:func:`check_demo`, :func:`check_node` and :func:`check_store` turn parsed
arguments into typed, frozen plans, or raise :class:`UsageError` with one
line naming the option and its value (exit code 2). They start no process
and leave no file behind: a directory is tested with a probe file that is
removed at once, because ``os.access`` says yes to root even on a read-only
file system.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import socket
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from ddpguide.core import commands
from ddpguide.elastic.demo import MAX_STEP_DELAY_S, MIN_EPOCHS, DemoSettings
from ddpguide.elastic.settings import (
    AgentSettings,
    UsageError,
    is_local_host,
    parse_endpoint,
    port_is_free,
)
from ddpguide.elastic.worker_args import STRATEGIES, WorkerArgs


@dataclass(frozen=True)
class DemoPlan:
    """What the local demo runs with."""

    settings: DemoSettings
    workdir: str | None = None
    report: str | None = None


@dataclass(frozen=True)
class NodeOptions:
    """What one ``node`` agent runs with, all of it checked."""

    agent: AgentSettings
    worker: WorkerArgs
    node_name: str
    warm: bool = True            # fork workers from a forkserver that has imported torch
    start_when: str | None = None


@dataclass(frozen=True)
class StoreOptions:
    """What a separate rendezvous store runs with."""

    port: int
    host: str = "127.0.0.1"


def _check_word(option: str, value: str) -> None:
    if not value or any(c.isspace() for c in value):
        raise UsageError(f"{option} {value!r}: must be a non-empty word")


def _check_checkpoint_option(path: str, strategy: str = WorkerArgs.strategy) -> None:
    """``--checkpoint``: where the strategy can save, holding nothing or what fits the toy model."""
    from ddpguide.core.checkpoint import CheckpointError, check_resumable
    from ddpguide.core.models import ToyModel

    if STRATEGIES[strategy].sharded:
        return _check_sharded_checkpoint(path)
    if Path(path).is_dir():
        from ddpguide.sharding.dcp import is_checkpoint

        raise UsageError(f"--checkpoint {path}: is " + (
            "a sharded checkpoint (a DCP directory): resume it with --strategy fsdp"
            if is_checkpoint(path) else "a directory"))
    try:
        with _warnings_as_notes():
            check_resumable(path, ToyModel())
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint {path}: {exc}") from None


def _check_sharded_checkpoint(path: str) -> None:
    """``--strategy fsdp``: a DCP directory of the toy model, or where one can be made.

    An existing checkpoint's saved keys and global shapes are compared with the
    toy model's: only its metadata is read, no tensor.
    """
    from ddpguide.core import checkpoint as one_file
    from ddpguide.core.models import ToyModel
    from ddpguide.sharding import dcp

    for name in (Path(path), one_file.previous_path(path)):
        if name.exists() and not name.is_dir():
            raise UsageError(f"--checkpoint {path}: {name} is a file, not a directory: a one-file "
                             "checkpoint is --strategy ddp's (--strategy fsdp saves a DCP directory)")
    try:
        one_file.check_writable_directory(path)
        problem = dcp.target_problem(Path(path).absolute())
        if problem:
            raise UsageError(f"--checkpoint {path}: {problem}")
        found = dcp.find_checkpoint(path)
        if found is not None:
            dcp.check_fits(ToyModel(), found)
    except (one_file.CheckpointError, dcp.CheckpointMismatch) as exc:
        raise UsageError(f"--checkpoint {path}: {exc}") from None


@contextlib.contextmanager
def _warnings_as_notes():
    """A fallback to ``.prev`` is allowed, but the reader hears of it (one line each)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)


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


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError:
        return False
    return True


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


def check_local_addr(addr: str) -> None:
    """``--local-addr`` must name this machine: binding to it (on any free port) is the test."""
    _check_word("--local-addr", addr)
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except OSError:
        raise UsageError(f"--local-addr {addr!r}: unknown host") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)
                return
            except OSError:
                continue
    raise UsageError(f"--local-addr {addr!r}: not an address of this machine")


def check_node(args: argparse.Namespace) -> NodeOptions:
    """Every ``node`` option, cheap checks first; the checkpoint is read last but one."""
    settings = AgentSettings.from_args(args).validate()
    worker = WorkerArgs.from_namespace(args).validate(node=True)
    _check_word("--node-name", args.node_name)
    if args.local_addr is not None:
        check_local_addr(args.local_addr)
    checkpoint = Path(worker.checkpoint).resolve()
    events = None
    if worker.events is not None:
        from ddpguide.core.checkpoint import previous_path

        # Opened for appending by workers that make no folders: its folder must exist.
        events = commands.check_output_file(worker.events, "--events", new_folders=False).resolve()
        # (a sharded checkpoint is a directory, whose files every save replaces)
        if {events, events.parent} & {checkpoint, previous_path(checkpoint)}:
            raise UsageError(f"--events {worker.events}: would write into the checkpoint")
    if args.start_when is not None:
        folder = Path(args.start_when).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--start-when {args.start_when}: directory {folder} does not "
                             "exist (the agent would wait for ever)")
    _check_checkpoint_option(worker.checkpoint, worker.strategy)
    if settings.may_host_store:
        check_endpoint(settings)
    # Absolute paths: the printed torchrun command must work from any directory.
    worker = replace(worker, checkpoint=str(checkpoint), events=str(events) if events else None)
    return NodeOptions(settings, worker, args.node_name,
                       warm=args.worker_start == "forkserver" and not args.torchrun_defaults,
                       start_when=args.start_when)


def check_demo(args: argparse.Namespace) -> DemoPlan:
    """The demo's options: sizes and pacing it can finish with, paths it can write."""
    if args.epochs < MIN_EPOCHS:
        raise UsageError(f"--epochs {args.epochs}: the demo needs at least {MIN_EPOCHS} epochs")
    if not (math.isfinite(args.step_delay) and 0 <= args.step_delay <= MAX_STEP_DELAY_S):
        raise UsageError(f"--step-delay {args.step_delay:g}: must be a number of seconds from "
                         f"0 to {MAX_STEP_DELAY_S:g} (each phase of the demo has a time limit)")
    if args.workdir is not None:
        workdir = Path(args.workdir)
        if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
            raise UsageError(f"--workdir {workdir}: must be a new or empty directory")
        existing = workdir.resolve()
        while not existing.exists():  # the directory and its parents are made when it starts
            existing = existing.parent
        why = commands.unwritable(existing)
        if why:
            raise UsageError(f"--workdir {workdir}: cannot be written in {existing} ({why})")
    if args.report is not None:
        commands.check_output_file(args.report, "--report", new_folders=False)
    settings = DemoSettings(epochs=args.epochs, step_delay=args.step_delay,
                            external_store=args.external_store,
                            torchrun_defaults=args.torchrun_defaults, strategy=args.strategy,
                            # torchrun's defaults wait up to 45 s for a lost node
                            phase_timeout_s=150.0 if args.torchrun_defaults else 60.0)
    return DemoPlan(settings, args.workdir, args.report)


def check_store(args: argparse.Namespace) -> StoreOptions:
    """The store's port must be valid and free; its host a word."""
    if not 1 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: outside 1-65535")
    _check_word("--host", args.host)
    if not port_is_free(args.host, args.port):
        raise UsageError(f"--port {args.port}: already in use on this machine")
    return StoreOptions(args.port, args.host)
