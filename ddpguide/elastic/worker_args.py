"""What every elastic worker is started with: the worker half of the command line.

:class:`WorkerArgs` is written once: its fields carry the defaults, the help
texts and the checks. ``node`` mode takes the same options (``timeout`` is
``--worker-timeout`` there, beside the agent's own options), writes them into
the workers' command line with :meth:`WorkerArgs.argv`, and the worker reads
them back with :meth:`WorkerArgs.parse`. A new worker option (say a training
``strategy``) is one new field here, with ``choices`` in its metadata.

:data:`STRATEGIES` is the one registry of training strategies by the name the
command line gives them: each entry says what the control plane must know of
its strategy (a sharded DCP directory or one checkpoint file, what a node's
forkserver should import) and builds the strategy object in the worker
(:class:`ddpguide.train.strategy.DDP`, :class:`ddpguide.sharding.fsdp_strategy.FSDP2`),
whose own ``name`` and ``sharded`` the tests hold equal to the entry's. Past the
command line, elastic code asks the entry, never the name.

Nothing here imports torch: a bad value is reported at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from ddpguide.core.commands import CommandLine, OneLineParser, option
from ddpguide.core.timeouts import MAX_TIMEOUT_S
from ddpguide.elastic.settings import UsageError

# toy_data holds (samples + 128) x 10 float32 features in every worker.
MAX_SAMPLES = 1_000_000
MAX_STEP_DELAY_S = 60.0   # a stand-in for compute, not a way to stall a job


@dataclass(frozen=True)
class StrategyChoice:
    """A training strategy as the control plane sees it, without importing torch."""

    name: str
    title: str                 # as the demo names it
    sharded: bool              # every rank saves its pieces into a DCP directory (else rank 0, one file)
    checkpoint_name: str       # the checkpoint's name in a demo's work directory
    preload: tuple[str, ...]   # modules a node's forkserver imports for the workers
    build: Callable[[], Any]   # the strategy object, built in the worker (imports torch)


def _ddp() -> Any:
    from ddpguide.train.strategy import DDP

    return DDP()


def _fsdp2() -> Any:
    from ddpguide.sharding.fsdp_strategy import FSDP2

    return FSDP2()


STRATEGIES = {
    "ddp": StrategyChoice("ddp", "DDP", sharded=False, checkpoint_name="checkpoint.pt",
                          preload=(), build=_ddp),
    "fsdp": StrategyChoice("fsdp", "FSDP2", sharded=True, checkpoint_name="checkpoint",
                           preload=("ddpguide.sharding.fsdp_strategy",), build=_fsdp2),
}


@dataclass(frozen=True)
class WorkerArgs(CommandLine):
    """The options of ``python -m ddpguide.elastic.worker`` (one field per option)."""

    checkpoint: str = field(metadata=option(
        "checkpoint shared by all nodes: a file, or a directory with --strategy fsdp", str,
        metavar="PATH"))
    epochs: int = field(default=12, metadata=option("epochs to train in all", int, metavar="N"))
    events: str | None = field(default=None, metadata=option(
        "append JSON-lines events to this file", str, metavar="PATH"))
    step_delay: float = field(default=0.0, metadata=option(
        "seconds to sleep after each step (stands in for real compute)", float, metavar="SECONDS"))
    samples: int = field(default=256, metadata=option("training samples per epoch", int,
                                                      metavar="N"))
    batch_size: int = field(default=16, metadata=option("samples per step, per worker", int,
                                                        metavar="N"))
    timeout: float = field(default=30.0, metadata=option(
        "seconds before a collective gives up", float, metavar="SECONDS",
        node_flag="--worker-timeout"))
    strategy: str = field(default="ddp", metadata=option(
        "ddp: DDP, rank 0 saves one checkpoint file; fsdp: FSDP2 (fully_shard), every rank "
        "saves its shards into a DCP directory", str, choices=tuple(STRATEGIES)))

    @property
    def strategy_choice(self) -> StrategyChoice:
        """The registry's entry for ``strategy``."""
        return STRATEGIES[self.strategy]

    @classmethod
    def parse(cls, argv: list[str] | None = None,
              prog: str = "python -m ddpguide.elastic.worker") -> WorkerArgs:
        """Read a worker command line back; bad input is one line on stderr and exit code 2."""
        parser = OneLineParser(prog=prog,
                               description="An elastic training worker (started by torchrun).")
        cls.add_arguments(parser)
        args = cls.from_namespace(parser.parse_args(argv))
        try:
            return args.validate()
        except UsageError as exc:
            parser.error(str(exc))

    def validate(self, node: bool = False) -> WorkerArgs:
        """Raise :class:`UsageError` naming the option and value of the first bad field.

        ``samples >= 1`` is enough for every epoch to take a step: the training
        sampler pads each rank's share to ``ceil(samples / world size)``, so
        with any world size every rank gets at least one (possibly short)
        batch. The world size is not known before the rendezvous anyway.
        """
        def bad(name: str, value: Any, rule: str) -> UsageError:
            shown = f"{value:g}" if isinstance(value, float) else repr(value)
            return UsageError(f"{self.flag(name, node)} {shown}: {rule}")

        for name in ("checkpoint", "events"):
            if getattr(self, name) == "":
                raise bad(name, "", "must not be empty")
        if self.epochs < 1:
            raise bad("epochs", self.epochs, "must be at least 1")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise bad("samples", self.samples, f"must be between 1 and {MAX_SAMPLES}")
        if self.batch_size < 1:
            raise bad("batch_size", self.batch_size, "must be at least 1")
        if not (math.isfinite(self.step_delay) and 0 <= self.step_delay <= MAX_STEP_DELAY_S):
            raise bad("step_delay", self.step_delay,
                      f"must be a number of seconds from 0 to {MAX_STEP_DELAY_S:g}")
        if not (math.isfinite(self.timeout) and 0 < self.timeout <= MAX_TIMEOUT_S):
            raise bad("timeout", self.timeout,
                      f"must be a number of seconds above 0, at most {MAX_TIMEOUT_S:g}")
        for f in fields(self):  # argparse checks choices; a WorkerArgs built in code is checked here
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise bad(f.name, getattr(self, f.name), f"must be one of {', '.join(choices)}")
        return self


