"""A rank's files as the runner reads them (:mod:`ddpguide.launch.ranks`): its logs, read as they
grow and echoed in whole lines, and the failure it records."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable

#: the file where a rank records its failure (:func:`record_failure`)
FAILURES_VARIABLE = "DDPGUIDE_FAILURES_FILE"


class Tail:
    """Log files read as they grow; ``echo`` gets whole lines only (the rest on ``final``)."""

    def __init__(self, echo: Callable[[str], None] | None = None):
        self.echo = echo
        self.paths: list[Path] = []
        self._data: dict[Path, bytearray] = {}
        self._shown: dict[Path, int] = {}

    def add(self, path: Path) -> None:
        if path not in self._data:
            self.paths.append(path)
            self._data[path], self._shown[path] = bytearray(), 0

    def poll(self, final: bool = False) -> None:
        for path in self.paths:
            data = self._data[path]
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(len(data))
                data += f.read()
            end = len(data) if final else data.rfind(b"\n") + 1
            if self.echo is not None and end > self._shown[path]:
                self.echo(bytes(data[self._shown[path]:end]).decode(errors="replace"))
            self._shown[path] = max(end, self._shown[path])

    def text(self, path: Path) -> str:
        return bytes(self._data.get(path, b"")).decode(errors="replace")


def record_failure(index: int, path: str | os.PathLike | None = None) -> None:
    """Record that rank ``index`` fails now, in its group's failures file (``path``, else the
    one :data:`FAILURES_VARIABLE` names; nothing without one): a time stamp and the index, in
    one ``O_APPEND`` write, which is atomic."""
    path = path or os.environ.get(FAILURES_VARIABLE)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{time.time():.6f} {index}\n".encode())
    finally:
        os.close(fd)


def recorded_failures(path: str | os.PathLike) -> list[int]:
    """The ranks that recorded a failure in ``path``, earliest time stamp first."""
    try:
        lines = Path(path).read_text().split("\n")
    except FileNotFoundError:
        return []
    stamped = [(float(when), int(index)) for when, _, index in (line.partition(" ") for line in lines)
               if index.isdigit()]
    return [index for _, index in sorted(stamped)]


def worker_errors(log_dir: str | os.PathLike) -> list[str]:
    """What the workers of one torchrun agent raised, as their error files hold it (each
    worker's ``TORCHELASTIC_ERROR_FILE``, which ``@record`` writes: ``<log-dir>/<run>/
    attempt_<n>/<local rank>/error.json``), read with torch's own :class:`ProcessFailure`.
    Earliest attempt first, then by the error's time stamp and the local rank; one line
    each, the first of the exception's message (``type: text``)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = []
    for path in Path(log_dir).glob("*/attempt_*/*/error.json"):
        attempt, local_rank = int(path.parent.parent.name.removeprefix("attempt_")), int(path.parent.name)
        failure = ProcessFailure(local_rank=local_rank, pid=0, exitcode=1, error_file=str(path))
        message = failure.message
        text = message.get("message", "") if isinstance(message, dict) else str(message)
        found.append(((attempt, failure.timestamp, local_rank), (text.strip().splitlines() or [""])[0]))
    return [line for _, line in sorted(found)]
