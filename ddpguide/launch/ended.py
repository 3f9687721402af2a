"""How a group of ranks ended (:mod:`ddpguide.launch.ranks`): the wait's :class:`Outcome`, the
group's :class:`Ended` and each rank's :class:`RankEnd`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    """How :meth:`Ranks.wait` ended (compared with ``is``: an outcome is never a string)."""

    DONE = "done"  #: every rank ended with status 0
    FAILED = "failed"  #: a rank failed (first failure: the others' grace is over; all_end: all ended)
    UNTIL = "until"  #: the caller's ``until()`` held
    TIMEOUT = "timeout"  #: the time was up


@dataclass
class RankEnd:
    """One rank's end: its name, status (None: still running when the group stopped it) and
    what it wrote to its own log (the group's output when it had none) and error log ('':
    its errors went to that log)."""

    name: str
    returncode: int | None
    output: str
    errors: str


@dataclass
class Ended:
    """How a group ended: each rank's status (None: still running when the group stopped it),
    the group's output (and error output when kept apart), the first rank that failed, the
    wall time, and each rank's own end (:attr:`ranks`)."""

    returncodes: list[int | None]
    output: str
    timed_out: bool
    first_failure: int | None
    seconds: float
    errors: str | None = None
    #: the ranks that could not be reaped after SIGKILL (stuck in the kernel), left behind
    unreaped: tuple[int, ...] = ()
    #: the status a launcher standing for the group exits with when a rank failed, whatever
    #: that rank's own (torchrun: 1); None: the failed rank's
    failed_status: int | None = None
    #: each rank's end, in the order they started
    ranks: list[RankEnd] = field(default_factory=list)

    @property
    def returncode(self) -> int:
        """One status for the group: ``failed_status`` or the failed rank's, -9 at the
        deadline, else 0."""
        if self.timed_out:
            return -9
        if self.first_failure is None:
            return 0
        return self.failed_status if self.failed_status is not None else int(
            self.returncodes[self.first_failure] or 1)
