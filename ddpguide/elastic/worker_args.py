"""What every elastic worker is started with: the worker half of the command line.

:class:`WorkerArgs` is written once: its fields carry the defaults, the help
texts and the checks. ``node`` mode takes the same options (``timeout`` is
``--worker-timeout`` there, beside the agent's own options), writes them into
the workers' command line with :meth:`WorkerArgs.argv`, and the worker reads
them back with :meth:`WorkerArgs.parse`. A new worker option (say a training
``strategy``) is one new field here, with ``choices`` in its metadata.

Nothing here imports torch: a bad value is reported at once.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ddpguide.core.commands import OneLineParser
from ddpguide.elastic.settings import UsageError

# toy_data holds (samples + 128) x 10 float32 features in every worker.
MAX_SAMPLES = 1_000_000
MAX_STEP_DELAY_S = 60.0   # a stand-in for compute, not a way to stall a job
MAX_TIMEOUT_S = 86_400.0  # datetime.timedelta and the stores take any day-sized timeout
STRATEGIES = ("ddp", "fsdp")


def _option(help: str, type: type, metavar: str | None = None, node_flag: str | None = None,
            choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Field metadata: how the field appears on a command line."""
    return {"help": help, "type": type, "metavar": metavar, "node_flag": node_flag,
            "choices": choices}


@dataclass(frozen=True)
class WorkerArgs:
    """The options of ``python -m ddpguide.elastic.worker`` (one field per option)."""

    checkpoint: str = field(metadata=_option(
        "checkpoint shared by all nodes: a file, or a directory with --strategy fsdp", str, "PATH"))
    epochs: int = field(default=12, metadata=_option("epochs to train in all", int, "N"))
    events: str | None = field(default=None, metadata=_option(
        "append JSON-lines events to this file", str, "PATH"))
    step_delay: float = field(default=0.0, metadata=_option(
        "seconds to sleep after each step (stands in for real compute)", float, "SECONDS"))
    samples: int = field(default=256, metadata=_option("training samples per epoch", int, "N"))
    batch_size: int = field(default=16, metadata=_option("samples per step, per worker", int, "N"))
    timeout: float = field(default=30.0, metadata=_option(
        "seconds before a collective gives up", float, "SECONDS", node_flag="--worker-timeout"))
    strategy: str = field(default="ddp", metadata=_option(
        "ddp: DDP, rank 0 saves one checkpoint file; fsdp: FSDP2 (fully_shard), every rank "
        "saves its shards into a DCP directory", str, choices=STRATEGIES))

    @staticmethod
    def flag(name: str, node: bool = False) -> str:
        """The option that sets field ``name`` (in ``node`` mode's spelling with ``node``)."""
        meta = WORKER_FIELDS[name].metadata
        return (node and meta["node_flag"]) or "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse._ActionsContainer, node: bool = False) -> None:
        """Add one option per field to ``parser`` (``dest`` is always the field's name)."""
        for f in fields(cls):
            meta = f.metadata
            required = f.default is MISSING
            help_text = meta["help"] + ("" if required or f.default is None
                                        else f" (default {f.default})")
            parser.add_argument(cls.flag(f.name, node), dest=f.name, type=meta["type"],
                                required=required, choices=meta["choices"],
                                metavar=meta["metavar"],
                                default=None if required else f.default, help=help_text)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> WorkerArgs:
        """The fields of a parsed command line (see :meth:`add_arguments`)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

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

    def argv(self, node: bool = False) -> list[str]:
        """The command line these arguments come from (``node`` mode's spelling with ``node``).

        The only place that writes a worker's command line; floats are written
        with ``repr`` so that :meth:`parse` reads back exactly the same value.
        """
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                text = repr(value) if isinstance(value, float) else str(value)
                out += [self.flag(f.name, node), text]
        return out

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


WORKER_FIELDS = {f.name: f for f in fields(WorkerArgs)}
