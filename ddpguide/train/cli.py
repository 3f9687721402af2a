"""Command line of the training core: the same loop, from a terminal or under torchrun.

One process::

    python -m ddpguide.train --epochs 1 --max-steps-per-epoch 20

Two workers on this machine (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, ...)::

    torchrun --standalone --nproc-per-node=2 -m ddpguide.train --epochs 1

Every worker runs :func:`main`. When the environment holds ``WORLD_SIZE`` (a
launcher started us) the worker joins the process group described by the
environment (``env://``), trains with :func:`ddpguide.train.loop.fit` and leaves the
group; otherwise it trains as a single process. :func:`main` is wrapped in
torchrun's ``@record``: an exception that escapes it is written, with its
traceback, to the file named by ``TORCHELASTIC_ERROR_FILE``, and torchrun's
failure summary shows that traceback instead of only "exit code 1".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddpguide.core import process_group
from ddpguide.core.commands import (
    OneLineParser,
    integer,
    positive_float,
    write_atomically,
)
from ddpguide.core.processes import exit_now
from ddpguide.core.ranklog import rank_print
from ddpguide.core.runtime import (
    BACKENDS,
    DEVICE_TYPES,
    DistEnv,
    Runtime,
    select_runtime,
)
from ddpguide.core.timeouts import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from ddpguide.train.cli_inputs import PROG, check_inputs
from ddpguide.train.loop import TrainConfig, TrainResult, fit


class DeliberateCrash(RuntimeError):
    """Raised by ``--crash-at-epoch``: a failure on purpose, to show the error file."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the tests of the cluster recipes)."""
    parser = OneLineParser(
        prog=PROG,
        description="Train the book's ConvNet with DistributedDataParallel: one process "
                    "under python, one process per worker under torchrun.",
        epilog="examples:\n"
               "  python -m ddpguide.train --epochs 1 --max-steps-per-epoch 20\n"
               "  torchrun --standalone --nproc-per-node=2 -m ddpguide.train --epochs 3\n"
               "  torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\\n"
               "      --rdzv-endpoint=HOST:29500 --rdzv-id=JOB -m ddpguide.train --amp auto",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    TrainConfig.add_arguments(parser)  # one option per field: --epochs, --batch-size, ...
    add = parser.add_argument
    add("--device", choices=("auto", *DEVICE_TYPES), default="auto",
        help="cuda (one GPU per local rank) or cpu; auto: cuda when this machine has a GPU "
             "for every local rank (default auto)")
    add("--backend", choices=("auto", *BACKENDS), default="auto",
        help="process-group backend: nccl (GPUs) or gloo (CPU); auto follows the device "
             "(default auto)")
    add("--timeout", type=positive_float(MAX_TIMEOUT_S), default=DEFAULT_TIMEOUT_S, metavar="S",
        help="seconds a collective may wait for the other ranks before it raises "
             f"(default {DEFAULT_TIMEOUT_S:g})")
    add("--json", metavar="FILE", default=None,
        help="rank 0 writes a summary of the run (per-epoch loss and accuracy, its step "
             "losses, the configuration) to FILE")
    add("--crash-at-epoch", type=integer(0), default=None, metavar="E",
        help="teaching switch: after E epochs, rank --crash-rank raises DeliberateCrash so "
             "that torchrun's error file can be seen; the other ranks wait in a barrier "
             "until torchrun stops them")
    add("--crash-rank", type=integer(0), default=0, metavar="R",
        help="the global rank that crashes with --crash-at-epoch (default 0)")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the arguments describe (checked when it is made)."""
    return TrainConfig.from_namespace(args)


def run(config: TrainConfig, env: DistEnv, runtime: Runtime,
        crash_at_epoch: int | None = None, crash_rank: int = 0) -> TrainResult:
    """Train on this rank; with ``crash_at_epoch``, fail on purpose after that many epochs."""
    if crash_at_epoch is None:
        return fit(config, env, runtime)
    result = fit(replace(config, epochs=crash_at_epoch), env, runtime)
    if env.rank == crash_rank:
        raise DeliberateCrash(f"rank {env.rank} crashed on purpose at the start of epoch "
                              f"{crash_at_epoch} (--crash-at-epoch)")
    if dist.is_initialized():
        dist.barrier()  # a collective the crashed rank never joins: torchrun has to step in
    return result


def summary(result: TrainResult, config: TrainConfig, runtime: Runtime,
            argv: Sequence[str]) -> dict:
    """What ``--json`` writes: the result, rank 0's step losses, the configuration."""
    return {
        "argv": list(argv),
        "config": asdict(config),
        "runtime": {"backend": runtime.backend, "device_type": runtime.device_type},
        "result": result.summary(),
        "accuracy": result.accuracy if result.test_total else None,
        "step_losses": result.step_losses,
    }


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, train on this rank, return the exit status.

    Under a launcher (``WORLD_SIZE`` in the environment) the worker joins the
    process group with a collective timeout and leaves it at the end; after a
    successful distributed run the process then exits at once, skipping the
    interpreter's teardown, in which gloo's threads occasionally abort
    ("terminate called without an active exception") and turn a good run into
    a failed one. Without a launcher, it trains in this process and returns 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if args.crash_at_epoch is not None and args.crash_at_epoch >= args.epochs:
            raise ValueError(f"--crash-at-epoch {args.crash_at_epoch} never happens with "
                             f"--epochs {args.epochs}")
        distributed = "WORLD_SIZE" in os.environ
        env = DistEnv.from_environ() if distributed else DistEnv.single()
        if args.crash_at_epoch is not None and args.crash_rank >= env.world_size:
            raise ValueError(f"--crash-rank {args.crash_rank} is not a rank of this run "
                             f"(WORLD_SIZE={env.world_size})")
        runtime = select_runtime(env.local_world_size,
                                 backend=None if args.backend == "auto" else args.backend,
                                 device_type=None if args.device == "auto" else args.device)
        # Files last: a checkpoint or summary that would fail the run after an
        # epoch fails it now, before a process group or a file exists.
        check_inputs(args, config, is_writer=env.is_main)
    except ValueError as exc:  # includes DistEnvError and InputError
        parser.error(str(exc))
    if not distributed:
        result = run(config, env, runtime, args.crash_at_epoch, args.crash_rank)
    else:
        env, runtime = process_group.setup(env, runtime, timeout_s=args.timeout)
        try:
            if config.log:
                rank_print(f"world size {env.world_size} ({env.local_world_size} per node), "
                           f"backend {runtime.backend} on {runtime.device_type}, "
                           f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
            result = run(config, env, runtime, args.crash_at_epoch, args.crash_rank)
        finally:
            process_group.cleanup()
    if args.json and env.is_main:
        write_atomically(args.json, json.dumps(summary(result, config, runtime, argv), indent=2))
    if distributed:
        exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
