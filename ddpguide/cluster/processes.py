"""Every process the cluster package starts goes through :func:`run_all`, on the one runner.

:func:`run_all` starts commands side by side (each usually prefixed with
``ip netns exec NODE``) as ranks of :class:`ddpguide.launch.ranks.Ranks`, waits
for all of them up to one deadline, and on a failure of any (or the deadline,
or Ctrl-C) stops every process tree it started, so that one dead rank never
leaves the others waiting.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from ddpguide.launch.ranks import Command, RankEnd, Ranks


def run_all(commands: list[list[str]], timeout: float, *, env: list[dict[str, str]] | None = None,
            cwd: str | Path | list[Path] | None = None, fail_fast: bool = True, capture: bool = True,
            echo: Callable[[str], None] | None = None,
            until: Callable[[list[int | None]], bool] | None = None) -> list[RankEnd]:
    """Run ``commands`` side by side; every one is done, or stopped, within ``timeout`` s.

    ``cwd`` is every command's folder, or one folder per command (each node's own disk).
    With ``fail_fast``, the first non-zero exit stops the others. Output is
    captured per command (``capture``); without it, lines are echoed as they come.
    ``until`` is called with the commands' exit statuses so far (None: running) on
    every turn of the runner's loop; once it returns True the ones still running are
    stopped (it may also act on the run, e.g. take a link down at the right moment).
    """
    with tempfile.TemporaryDirectory(prefix="ddpguide-cluster-") as folder, \
            Ranks(echo=None if capture else (echo or (lambda line: print(line, flush=True))),
                  workdir=folder) as group:
        logs = [(Path(folder, f"{k}.out"), Path(folder, f"{k}.err")) for k in range(len(commands))]
        for k, argv in enumerate(commands):
            group.start(Command(argv, cwd=cwd[k] if isinstance(cwd, list) else cwd,
                                base_env=None if env is None else env[k],
                                log=logs[k][0] if capture else None,
                                errors=logs[k][1] if capture else None))
        try:
            group.wait(timeout, all_end=not fail_fast,
                       until=None if until is None else lambda: until(group.returncodes()))
        finally:
            group.stop(grace=3.0)
        return group.ended().ranks
