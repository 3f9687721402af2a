"""The demo's progress on stderr: a bar over the epochs, beside the timeline on stdout.

``python -m ddpguide.elastic`` prints its timeline on stdout, one line per event as it
happens, and its summary at the end. :class:`EpochBar` adds a ``tqdm`` bar on stderr
that counts the finished epochs and names the world size training runs at, or the
group being replaced. The bar draws only on a terminal (``tqdm``'s rule), so a pipe,
a log file or a notebook gets the timeline alone; timeline lines go through the bar,
which clears itself before each one and draws itself again after it.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


class EpochBar:
    """Finished epochs out of ``total``, from the workers' event lines (rank 0's)."""

    def __init__(self, total: int, stream: TextIO | None = None, out: TextIO | None = None,
                 enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        if enabled is None:
            enabled = self.stream.isatty()
        self.enabled = enabled
        self.done: set[int] = set()
        self.bar = tqdm(total=total, desc="epochs", unit="epoch", file=self.stream,
                        disable=not enabled, dynamic_ncols=True, mininterval=0.2)

    def event(self, e: dict[str, Any]) -> None:
        """One line of the workers' event file."""
        if e.get("rank") != 0:
            return
        if e["event"] == "epoch" and e["epoch"] not in self.done:
            self.done.add(e["epoch"])
            self.bar.set_postfix_str(f"world size {e['world_size']}", refresh=False)
            self.bar.update(1)
        elif e["event"] == "start":
            self.bar.set_postfix_str(f"a group of {e['world_size']} starts at epoch {e['epoch']}")

    def echo(self, line: str) -> None:
        """A timeline line on stdout, the bar cleared around it."""
        if self.enabled:
            self.bar.write(line, file=self.out)
            self.out.flush()
        else:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> EpochBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
