"""The files ``python -m ddpguide.train`` reads and writes, checked before it starts.

A run that would fail at its first save or at its summary, after minutes of
training, fails now instead: one line naming the option, exit status 2, and
nothing created, written or moved. The checkpoint must be readable (or absent)
and fit the model; its folder, and the summary's, must take new files; the
summary must not overwrite the checkpoint or a file it did not write.
"""

from __future__ import annotations

import argparse
import warnings

from ddpguide.core.checkpoint import CheckpointError, check_resumable, previous_path
from ddpguide.core.commands import InputError, check_output_file, json_with_keys
from ddpguide.core.data import mnist_available, mnist_root
from ddpguide.core.models import build_model
from ddpguide.train.loop import TrainConfig

PROG = "python -m ddpguide.train"
#: The keys of a summary this command wrote (``--json``): such a file may be replaced.
SUMMARY_KEYS = ("argv", "config", "result")


def check_inputs(args: argparse.Namespace, config: TrainConfig, is_writer: bool) -> None:
    """Raise :class:`InputError` for the first input the run would fail on later.

    ``is_writer``: this rank saves the checkpoint and writes the summary (rank 0);
    the others only read the checkpoint, so only its readability is theirs to check.
    """
    if config.dataset == "mnist" and not mnist_available():
        raise InputError("--dataset", f"mnist files not found under {mnist_root() / 'MNIST' / 'raw'} "
                                      "(set DDPGUIDE_MNIST_ROOT, or use --dataset digits)")
    if args.checkpoint is not None:
        if not args.checkpoint:
            raise InputError("--checkpoint", "empty file name")
        try:
            # The run warns about a damaged latest file when it loads the fallback; once is enough.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                check_resumable(args.checkpoint, build_model(config.model), writer=is_writer)
        except CheckpointError as exc:
            raise InputError("--checkpoint", str(exc)) from None
    if args.json is not None and is_writer:
        protected = []
        if args.checkpoint:
            protected = [(args.checkpoint, "the checkpoint (--checkpoint)"),
                         (previous_path(args.checkpoint), "the checkpoint's fallback (--checkpoint)")]
        check_output_file(args.json, "--json", protected=protected,
                          may_replace=json_with_keys(SUMMARY_KEYS),
                          replaceable=f"a summary written by {PROG}")
