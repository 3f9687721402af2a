"""Rank-aware printing: a rank prefix on every line, rank-0-only output, progress bars.

In a distributed job every rank runs the same script, so an unqualified
``print`` appears N times and nobody can tell which rank said what.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, TypeVar

T = TypeVar("T")


def current_rank() -> int:
    """This process's global rank: from the process group, else RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch without distributed
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def rank_print(*values: object, all_ranks: bool = False, **kwargs: Any) -> None:
    """Print with a ``[rank N]`` prefix; by default only rank 0 prints."""
    rank = current_rank()
    if all_ranks or rank == 0:
        sep, end = kwargs.get("sep"), kwargs.get("end")
        sep, end = " " if sep is None else sep, "\n" if end is None else end  # as print does
        stream = kwargs.get("file") or sys.stdout
        # One write per line: unbuffered output (PYTHONUNBUFFERED, torchrun's
        # workers) would otherwise write the prefix, each value and the newline
        # separately, and another rank's line could land between them.
        stream.write(sep.join(map(str, (f"[rank {rank}]", *values))) + end)
        if kwargs.get("flush", True):
            stream.flush()


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


def get_logger(name: str = "ddpguide", level: int = logging.INFO) -> logging.Logger:
    """A logger whose every line starts with the time and the rank."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_ddpguide", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler._ddpguide = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger


def progress(iterable: Iterable[T], enabled: bool | None = None, **kwargs: Any) -> Iterable[T]:
    """A tqdm progress bar on rank 0; the plain iterable elsewhere.

    By default the bar is drawn only when stderr is a terminal: a worker whose
    output goes to a log file would fill it with carriage returns.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or current_rank() != 0:
        return iterable
    from tqdm.auto import tqdm

    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    bar: Iterable[T] = tqdm(iterable, **kwargs)
    return bar
