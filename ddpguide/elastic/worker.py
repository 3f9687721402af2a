"""One elastic worker: what torchrun's agent starts on every rank.

``node`` mode forks it from a warm forkserver (:func:`elastic_entry`); plain
``torchrun ... -m ddpguide.elastic.worker`` execs it (:func:`main`).

It is the book's training loop (:func:`ddpguide.train.loop.fit`) on the source's toy
model, with the DDP strategy (or, with ``--strategy fsdp``, FSDP2:
:class:`ddpguide.sharding.fsdp_strategy.FSDP2`), with three additions that make elasticity safe and visible:

* the training state lives in a checkpoint written atomically after every
  epoch (by rank 0; with ``fsdp`` by every rank, its own shards), so a
  restarted group (of any size) continues after the last finished epoch;
* a ``--step-delay`` sleep per step stands in for real compute, so that the
  demo's joins, departures and crashes land in the middle of training;
* rank 0 reports what happens (start, resume epoch, first step, every finished
  epoch) to an event file; every rank reports its pid once.

The module imports nothing heavy at the top, so ``--help`` and a fresh
interpreter's start stay cheap.
"""

from __future__ import annotations

import os
import sys

from ddpguide.core.commands import one_line
from ddpguide.core.processes import die_with_parent, exit_now
from ddpguide.elastic.worker_args import WorkerArgs


def parse_args(argv: list[str] | None = None) -> WorkerArgs:
    """The worker's command line, as ``node`` mode wrote it (:meth:`WorkerArgs.argv`)."""
    return WorkerArgs.parse(argv)


def toy_data(samples: int, test_samples: int = 128, seed: int = 0):
    """The source's toy problem made learnable: 10 features, 5 classes from a fixed linear map."""
    import torch
    from torch.utils.data import TensorDataset

    from ddpguide.core.data import DataSplits

    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(10, 5, generator=gen)
    x = torch.randn(samples + test_samples, 10, generator=gen)
    y = (x @ mixing).argmax(dim=1)
    return DataSplits("toy", TensorDataset(x[:samples], y[:samples]),
                      TensorDataset(x[samples:], y[samples:]))


def run(args: WorkerArgs) -> None:
    """Join the group torchrun describes, train to ``args.epochs``, leave."""
    from ddpguide.core.runtime import DistEnv
    from ddpguide.elastic.events import EventWriter

    dist_env = DistEnv.from_environ()
    rank = dist_env.rank
    events = None
    if args.events:
        events = EventWriter(args.events, node=os.environ.get("DDPGUIDE_NODE", ""), rank=rank,
                             local_rank=dist_env.local_rank, world_size=dist_env.world_size,
                             pid=os.getpid(), group=str(dist_env.master_port),
                             restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        events.write("spawned")

    from ddpguide.core.process_group import cleanup, setup
    from ddpguide.train.loop import TrainConfig, fit

    setup(dist_env, timeout_s=args.timeout)
    if events and rank == 0:
        events.write("ready")

    def on_event(name: str, **fields) -> None:
        if events is not None and rank == 0:
            events.write(name, **fields)

    config = TrainConfig(model="toy", epochs=args.epochs, batch_size=args.batch_size,
                         checkpoint=args.checkpoint, step_delay_s=args.step_delay,
                         progress=False, log=True)
    fit(config, data=toy_data(args.samples), on_event=on_event, strategy=args.strategy_choice.build())
    if events and rank == 0:
        events.write("finished")
    cleanup()


def elastic_entry(*argv: str) -> None:
    """Entry point when the agent forks workers (node mode's default).

    torchrun's multiprocessing wrapper records an exception in the error file
    and the child then exits without interpreter teardown.
    """
    die_with_parent()
    run(parse_args(list(argv)))


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    args = parse_args(argv)
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        # @record writes the traceback to TORCHELASTIC_ERROR_FILE, so the agent
        # can name the root cause of a failed group.
        record(run)(args)
    except BaseException as exc:  # noqa: BLE001 - the process ends here either way
        message = one_line(exc, 300)
        print(f"[rank {os.environ.get('RANK', '?')}] worker failed: {type(exc).__name__}: {message}",
              file=sys.stderr)
        exit_now(1)
    exit_now(0)


if __name__ == "__main__":
    main()
