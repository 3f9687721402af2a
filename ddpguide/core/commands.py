"""What every command line of the package shares: its inputs are checked before anything runs.

A bad input is one line on stderr that names the option and the value, exit
status 2, and nothing started, written or moved:

* :class:`OneLineParser`: argparse, but an error is one line (argparse's usage
  block would bury it in a job log with many workers);
* :func:`integer` and :func:`positive_float`: argument types with a range;
* :func:`check_output_file`: an output file can be written when the run ends,
  and would not clobber a file it should not; checked now, creating nothing;
* :func:`write_atomically`: the output is written whole or not at all;
* :class:`CommandLine` and :func:`option`: a dataclass whose fields write
  their own options (help, type, choices in the field's metadata), read
  them back and write them out again as a command line;
* :func:`one_line`: an exception's message on one line, for an error report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Self


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class InputError(ValueError):
    """A bad input, found before the run: the message names the option and the value.

    ``InputError(option, message)`` reads "argument OPTION: MESSAGE" (argparse's
    words); ``InputError(message)`` is the message alone, for commands whose
    messages already start with the option (the doctor's and the elastic
    command's ``UsageError`` is this class).
    """

    def __init__(self, option_or_message: str, message: str | None = None):
        self.option = None if message is None else option_or_message
        super().__init__(option_or_message if message is None
                         else f"argument {option_or_message}: {message}")


def one_line(exc: BaseException | str, limit: int = 200, *, last: bool = False) -> str:
    """``exc``'s message folded onto one line, cut at ``limit`` characters.

    With ``last``, only the message's last non-empty line (where an error
    raised inside another, e.g. by a worker, says what finally went wrong),
    without the ``[file.cpp:line] `` location gloo puts in front; the
    exception's type name when the message is empty.
    """
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch's reason, without the advice around it
        reason = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0]
        text = f"weights-only load refused: {reason}"
    lines = [part.strip() for part in text.strip().splitlines() if part.strip()]
    if last:
        text = lines[-1] if lines else type(exc).__name__
        text = text.split("] ", 1)[-1] if text.startswith("[") else text
    else:
        text = " ".join(" ".join(lines).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def option(help: str, type: Callable[[str], Any] | None = str, *, metavar: str | None = None,
           choices: tuple[str, ...] | None = None, flag: str | None = None,
           node_flag: str | None = None, action: str | None = None) -> dict[str, Any]:
    """Field metadata: how a :class:`CommandLine` dataclass field appears on a command line.

    ``flag`` replaces the default spelling ``--field-name``; ``node_flag`` is
    the spelling in a second, wider command line that embeds this one;
    ``action`` is ``"store_true"`` or ``"store_false"`` for a switch.
    """
    return {"help": help, "type": type, "metavar": metavar, "choices": choices, "flag": flag,
            "node_flag": node_flag, "action": action}


class CommandLine:
    """A dataclass mixin: fields with :func:`option` metadata are the command's options.

    Written once, a field gives its default, help, type and choices to
    :meth:`add_arguments`, is read back by :meth:`from_namespace` and written out
    again by :meth:`argv` (so a launcher passes the same values to its workers).
    Fields without the metadata are settings the command line does not reach.
    """

    @classmethod
    def options(cls) -> list[Field[Any]]:
        """The fields that are options, in order."""
        return [f for f in fields(cls) if "help" in f.metadata]  # type: ignore[arg-type]

    @classmethod
    def metadata(cls, name: str) -> Any:
        """Field ``name``'s :func:`option` metadata (its help, type, choices, ...)."""
        return next(f for f in cls.options() if f.name == name).metadata

    @classmethod
    def flag(cls, name: str, node: bool = False) -> str:
        """The option that sets field ``name`` (in the wider command line's spelling with ``node``)."""
        meta = cls.metadata(name)
        return (node and meta["node_flag"]) or meta["flag"] or "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | Any, node: bool = False) -> None:
        """Add one option per field to ``parser`` (``dest`` is always the field's name)."""
        for f in cls.options():
            meta, required = f.metadata, f.default is MISSING
            if meta["action"]:
                parser.add_argument(cls.flag(f.name, node), dest=f.name, action=meta["action"],
                                    help=meta["help"])
                continue
            shown = "" if required or f.default is None else f" (default {f.default})"
            parser.add_argument(cls.flag(f.name, node), dest=f.name, type=meta["type"],
                                required=required, choices=meta["choices"],
                                metavar=meta["metavar"],
                                default=None if required else f.default, help=meta["help"] + shown)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace, **others: Any) -> Self:
        """The dataclass a parsed command line describes (``others``: the fields it has no option for)."""
        return cls(**{f.name: getattr(namespace, f.name) for f in cls.options()}, **others)

    def argv(self, node: bool = False) -> list[str]:
        """The command line these values come from; floats written with ``repr`` (read back exactly)."""
        out: list[str] = []
        for f in self.options():
            value, action = getattr(self, f.name), f.metadata["action"]
            if action:
                if value != (action == "store_false"):
                    out.append(self.flag(f.name, node))
            elif value is not None:
                out += [self.flag(f.name, node), repr(value) if isinstance(value, float) else str(value)]
        return out


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


def unwritable(folder: str | os.PathLike[str]) -> str | None:
    """Why no new file can be made in ``folder`` (None: one can).

    Probed with a temporary file that is removed at once: ``os.access`` says
    yes to root even on a read-only file system.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "not a directory" if folder.exists() else "no such directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def check_output_file(path: str | os.PathLike[str], option: str, *,
                      protected: Iterable[tuple[str | os.PathLike[str], str]] = (),
                      may_replace: Callable[[Path], bool] | None = None,
                      replaceable: str = "an earlier output of this command",
                      new_folders: bool = True) -> Path:
    """Raise :class:`InputError` unless ``path`` can be written at the end of the run.

    Refused: a directory or other non-file; one of the ``protected`` files
    (``(path, description)`` pairs, e.g. the checkpoint); an existing file that
    ``may_replace`` rejects; a place where the missing folders cannot be made
    (an ancestor that is a file, a folder that takes no new files), or, with
    ``new_folders=False`` (a file opened for appending, whose folder nobody
    makes), a missing folder. Creates nothing. Returns the absolute path.
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
    ancestor = target.absolute().parent
    while new_folders and not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise InputError(option, f"{ancestor} is not a directory")
    if not ancestor.exists():
        raise InputError(option, f"folder {ancestor} does not exist")
    why = unwritable(ancestor)
    if why:
        raise InputError(option, f"cannot write in {ancestor} ({why})")
    return target.absolute()


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
