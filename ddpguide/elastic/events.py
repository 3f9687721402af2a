"""Events of an elastic run: workers append JSON lines, the orchestrator tails them.

Several worker groups write to the same file over a run, and an old group may
still be dying while the next one starts. So every line is self-describing:
a ``time.monotonic()`` timestamp (one clock for every process on a machine),
the writer's pid, its worker group (the group's MASTER_PORT, fresh each round),
the node and the agent's restart count. Each line goes out in one ``write``
on a file opened with ``O_APPEND``, so lines from different processes never
interleave.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class EventWriter:
    """Appends one JSON object per line; safe to share a file between processes."""

    def __init__(self, path: str | os.PathLike, **common: Any) -> None:
        self.path = Path(path)
        self.common = common
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        """Append ``event`` with the common fields and ``fields``, stamped now."""
        record = {"t": time.monotonic(), "event": event, **self.common, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class EventTail:
    """Reads the complete lines added to an event file since the last poll."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._offset = 0
        self._pending = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()  # an incomplete last line waits for the next poll
        return [json.loads(line) for line in lines if line.strip()]
