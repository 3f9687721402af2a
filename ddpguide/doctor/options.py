"""The doctor's command line: every option is checked before anything starts.

An invalid option prints one line naming it and its value and exits with
status 2, before any process starts or any file is written.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NoReturn, Sequence

from ddpguide.core.commands import InputError

PROG = "python -m ddpguide.doctor"
#: 4 KiB, 16 KiB, ... 16 MiB: quick on a laptop (gloo on the CPU).
DEFAULT_SIZES = tuple(4096 * 4 ** i for i in range(7))
#: 4 KiB ... 1 GiB on GPUs: nccl-tests' bus bandwidth reaches its plateau near the top.
DEFAULT_GPU_SIZES = tuple(4096 * 4 ** i for i in range(10))
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_NPROC = 2
MAX_SIZE = 2 ** 30
MAX_NPROC = 64
_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "KB": 2 ** 10, "KIB": 2 ** 10, "M": 2 ** 20,
          "MB": 2 ** 20, "MIB": 2 ** 20, "G": 2 ** 30, "GB": 2 ** 30, "GIB": 2 ** 30}


#: An invalid option (the message names it and its value): the package's one bad-input error.
UsageError = InputError


@dataclass(frozen=True)
class Options:
    """What the doctor was asked to do."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    sizes: tuple[int, ...] | None = None     # all-reduce sweep in bytes; () skips it; None: default
    nproc: int = DEFAULT_NPROC               # ranks of the local group (no launcher only)
    json_path: Path | None = None
    checkpoint_dir: Path | None = None       # checked: writable, the same on every rank
    checkpoint_bytes: int | None = None      # free space needed there (one checkpoint)

    def sizes_for(self, device_type: str) -> tuple[int, ...]:
        """The sweep's sizes: as asked, else 4 KiB..16 MiB on the CPU, 4 KiB..1 GiB on GPUs."""
        if self.sizes is not None:
            return self.sizes
        return DEFAULT_GPU_SIZES if device_type == "cuda" else DEFAULT_SIZES

    def rank_argv(self) -> list[str]:
        """The same options for the ranks a local launch starts (``--nproc`` is the parent's)."""
        argv = ["--timeout", f"{self.timeout_s:g}"]
        if self.sizes is not None:
            argv += ["--sizes", ",".join(str(s) for s in self.sizes) if self.sizes else "none"]
        if self.json_path is not None:
            argv += ["--json", str(self.json_path)]
        if self.checkpoint_dir is not None:
            argv += ["--checkpoint-dir", str(self.checkpoint_dir)]
        if self.checkpoint_bytes is not None:
            argv += ["--checkpoint-size", str(self.checkpoint_bytes)]
        return argv


def watchdog_limit_s(options: Options) -> float:
    """The longest a rank may run: rendezvous, verdict, one failing collective, the results."""
    return 3 * options.timeout_s + 120.0


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16MiB"`` -> 16777216, ``"1024"`` -> 1024 (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 4K, 16M)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"``; the largest unit that divides the size exactly."""
    for unit, factor in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def _sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    sizes = []
    for part in text.split(","):
        try:
            size = parse_size(part)
        except ValueError as error:
            raise UsageError(f"--sizes {text!r}: {error}") from None
        if not 4 <= size <= MAX_SIZE or size % 4:
            raise UsageError(f"--sizes {text!r}: {part.strip()} must be a multiple of 4 bytes "
                             f"(float32) between 4 B and 1 GiB")
        sizes.append(size)
    return tuple(sizes)


def _json_path(text: str) -> Path:
    """A file we could create or overwrite; checked without writing anything."""
    path = Path(text)
    if not text or path.is_dir():
        raise UsageError(f"--json {text!r}: is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--json {text!r}: folder {str(parent)!r} does not exist")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK):
        raise UsageError(f"--json {text!r}: {str(target)!r} is not writable")
    return path.absolute()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also gives ``--help``)."""
    parser = _Parser(prog=PROG, description="Pre-flight check of a distributed PyTorch job: "
                     "launcher variables, rendezvous, GPUs, collectives, bandwidth.")
    parser.add_argument("--timeout", metavar="S", default=str(DEFAULT_TIMEOUT_S),
                        help="seconds for the rendezvous and for each collective "
                             f"(default {DEFAULT_TIMEOUT_S:g}); the whole run ends within "
                             "3 x S + 120 s after start-up (a watchdog per rank)")
    parser.add_argument("--sizes", metavar="LIST", default=None,
                        help="all-reduce sweep message sizes, e.g. 4K,1M,16M, or 'none' "
                             "(default 4K..16M in steps of 4x on the CPU, 4K..1G on GPUs)")
    parser.add_argument("--nproc", metavar="N", default=None,
                        help=f"without a launcher: ranks of the local group (default {DEFAULT_NPROC})")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    parser.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                        help="check that every rank can write DIR and sees the others' files there")
    parser.add_argument("--checkpoint-size", metavar="SIZE", default=None,
                        help="with --checkpoint-dir: free space one checkpoint needs, e.g. 40G")
    return parser


def parse_options(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Options:
    """Parse and check every option; raises :class:`UsageError` with a one-line message."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(list(argv))
    try:
        timeout_s = float(args.timeout)
    except ValueError:
        raise UsageError(f"--timeout {args.timeout!r}: not a number of seconds") from None
    if not 0 < timeout_s <= 3600:
        raise UsageError(f"--timeout {args.timeout!r}: must be more than 0 and at most 3600 seconds")
    sizes = None if args.sizes is None else _sizes(args.sizes)
    nproc = DEFAULT_NPROC
    if args.nproc is not None:
        if "RANK" in environ:
            raise UsageError(f"--nproc {args.nproc!r}: a launcher started this process "
                             f"(RANK={environ['RANK']}); the launcher decides the number of ranks")
        if not args.nproc.isdigit() or not 1 <= int(args.nproc) <= MAX_NPROC:
            raise UsageError(f"--nproc {args.nproc!r}: must be a whole number from 1 to {MAX_NPROC}")
        nproc = int(args.nproc)
    json_path = None if args.json is None else _json_path(args.json)
    checkpoint_dir = None
    if args.checkpoint_dir is not None:
        checkpoint_dir = Path(args.checkpoint_dir).absolute()
        if not checkpoint_dir.is_dir():
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r}: not a directory")
    checkpoint_bytes = None
    if args.checkpoint_size is not None:
        if checkpoint_dir is None:
            raise UsageError("--checkpoint-size needs --checkpoint-dir")
        try:
            checkpoint_bytes = parse_size(args.checkpoint_size)
        except ValueError as error:
            raise UsageError(f"--checkpoint-size {args.checkpoint_size!r}: {error}") from None
    return Options(timeout_s, sizes, nproc, json_path, checkpoint_dir, checkpoint_bytes)


def options_or_exit(argv: Sequence[str]) -> Options:
    """:func:`parse_options`, or one line on stderr and exit status 2."""
    try:
        return parse_options(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
