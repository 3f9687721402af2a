"""What the Slurm tests that start daemons share: this machine's Slurm state.

Their checks of "nothing left" compare the machine's Slurm folders, records and daemons
before and after, so a cluster another test starts meanwhile counts as left behind (two
pytest-xdist workers run at once). Every test that starts a Slurm cluster, or compares that
state, asks for :func:`slurm_machine`: the files that do run in one worker, one test after
another (``tests/worker_groups.py``), and once the last has ended nothing of Slurm is left.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ddpguide.cluster import netns
from ddpguide.slurm import config, daemons, scheduler


@pytest.fixture(scope="session")
def slurm_machine() -> Iterator[None]:
    yield
    left = [*scheduler.folders(), *(["munged.json"] if daemons.MUNGE_RECORD.exists() else []),
            *(k for k, r in netns.read_records().items() if r.get("holder") == scheduler.HOLDER)]
    assert not left, f"left in {config.FOLDERS} or the records after the Slurm tests: {left}"
