"""What every command line of the package shares: its inputs are checked before anything runs.

A bad input is one line on stderr that names the option and the value, exit
status 2, and nothing started, written or moved:

* :class:`OneLineParser`: argparse, but an error is one line (argparse's usage
  block would bury it in a job log with many workers);
* :func:`integer` and :func:`positive_float`: argument types with a range;
* :func:`check_output_file`: an output file can be written when the run ends,
  and would not clobber a file it should not; checked now, creating nothing;
* :func:`write_atomically`: the output is written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class InputError(ValueError):
    """A bad input, found before the run: the message names the option and the value."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"argument {option}: {message}")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def positive_float(maximum: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (and <= ``maximum``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value
    parse.__name__ = "number > 0"
    return parse


def json_with_keys(keys: Iterable[str]) -> Callable[[Path], bool]:
    """A test for :func:`check_output_file`: an empty file, or JSON objects with ``keys``
    (one, or a list of them): what the command itself wrote before."""
    keys = set(keys)

    def written_by_us(path: Path) -> bool:
        try:
            text = path.read_text()
            if not text.strip():
                return True
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        items = data if isinstance(data, list) and data else [data]
        return all(isinstance(item, dict) and keys <= item.keys() for item in items)
    return written_by_us


def _same_path(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_output_file(path: str | os.PathLike[str], option: str, *,
                      protected: Iterable[tuple[str | os.PathLike[str], str]] = (),
                      may_replace: Callable[[Path], bool] | None = None,
                      replaceable: str = "an earlier output of this command") -> Path:
    """Raise :class:`InputError` unless ``path`` can be written at the end of the run.

    Refused: a directory or other non-file; one of the ``protected`` files
    (``(path, description)`` pairs, e.g. the checkpoint); an existing file that
    ``may_replace`` rejects; a place where the missing folders cannot be made
    (an ancestor that is a file, a folder that takes no new files). Creates
    nothing: writability is probed with a temporary file that is removed.
    """
    if not str(path):
        raise InputError(option, "empty file name")
    target = Path(path)
    if target.is_dir():
        raise InputError(option, f"{target} is a directory")
    if target.exists() and not target.is_file():
        raise InputError(option, f"{target} is not a regular file")
    for other, description in protected:
        if _same_path(target, Path(other)):
            raise InputError(option, f"{target} is {description}")
    if target.is_file() and may_replace is not None and not may_replace(target):
        raise InputError(option, f"{target} exists and is not {replaceable}; refusing to "
                                 "overwrite it")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(option, f"{ancestor} is not a directory")
    try:
        # os.access says yes to root even on a read-only file system: try it.
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=ancestor)
    except OSError as exc:
        raise InputError(option, f"cannot write in {ancestor} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return target


def write_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (making missing folders) so that a reader never sees half."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        partial.write_text(text)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target
