"""The options of a training run: :class:`TrainConfig`, which also writes ``python -m ddpguide.train``'s options."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpguide.core.commands import CommandLine, integer, option, positive_float
from ddpguide.train import amp as amp_mod

MAX_SEED = 2 ** 64 - 1  # torch.manual_seed takes no more
DATASETS = ("auto", "mnist", "digits")


@dataclass
class TrainConfig(CommandLine):
    """Every knob of a training run; chapters add options here, never copies of the loop.

    A field with :func:`~ddpguide.core.commands.option` metadata is an option of
    ``python -m ddpguide.train`` (its help, type and choices are written here
    once); the others are set in code. A bad value raises ``ValueError`` when
    the config is made, so no caller can skip the check.
    """

    model: str = "convnet"
    dataset: str = field(default="auto", metadata=option(
        "mnist (local files only), digits (bundled with scikit-learn), or auto: MNIST when its "
        "files exist, else digits", choices=DATASETS))
    epochs: int = field(default=3, metadata=option(
        "passes over the training set", integer(0), metavar="N"))
    batch_size: int = field(default=32, metadata=option(  # per rank, as in the source article
        "samples per step on each rank; the global batch is B x WORLD_SIZE", integer(1),
        metavar="B"))
    lr: float = field(default=0.02, metadata=option(
        "SGD learning rate", positive_float(), metavar="LR"))
    momentum: float = 0.9
    seed: int = field(default=0, metadata=option(
        "seed of the model initialisation, the same on every rank", integer(0, MAX_SEED),
        metavar="S"))
    data_seed: int = 3407         # sampler shuffling and loader generators
    max_steps_per_epoch: int | None = field(default=None, metadata=option(
        "stop each epoch after N steps (quick runs; default: the whole epoch)", integer(1),
        metavar="N"))
    checkpoint: str | None = field(default=None, metadata=option(
        "rank 0 saves here after every epoch; a run finding the file resumes from it",
        metavar="FILE"))
    amp: str = field(default="off", metadata=option(
        "mixed precision: off, auto (fp16 on CUDA, bf16 on CPU), bf16 or fp16",
        choices=amp_mod.AMP_CHOICES))
    sync_bn: bool = field(default=False, metadata=option(
        "convert BatchNorm layers to synchronised batch norm across ranks", action="store_true"))
    evaluate: bool = field(default=True, metadata=option(
        "skip the test-set evaluation after each epoch", flag="--no-eval", action="store_false"))
    progress: bool | None = None  # progress bar on rank 0 (default: when stderr is a terminal)
    log: bool = field(default=True, metadata=option(
        "no per-epoch log lines", flag="--quiet", action="store_false"))
    step_delay_s: float = 0.0     # sleep after each step: makes a toy run slow enough to watch

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> TrainConfig:
        """Raise ValueError with one clear sentence for a bad value (also run on creation)."""
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr}")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise ValueError(f"max_steps_per_epoch must be >= 1, got {self.max_steps_per_epoch}")
        if self.step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {self.step_delay_s}")
        if (self.amp or "off").lower() not in amp_mod.AMP_CHOICES:
            raise ValueError(f"unknown amp mode {self.amp!r}: choose one of "
                             f"{', '.join(amp_mod.AMP_CHOICES)}")
        return self
