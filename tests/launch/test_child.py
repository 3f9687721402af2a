"""The child side of spawn: failures are recorded in the order they happen."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from ddpguide.launch.child import FAILURES_FILE, first_failure, record_failure


def test_the_first_rank_to_record_is_the_cause_whatever_its_number(tmp_path):
    record_failure(tmp_path, 3)
    record_failure(tmp_path, 0)
    record_failure(tmp_path, 1)
    assert (tmp_path / FAILURES_FILE).read_text() == "3\n0\n1\n"
    assert first_failure(tmp_path, [0, 1, 3]) == 3


def test_without_records_the_lowest_failed_rank_is_named(tmp_path):
    """A rank killed by a signal records nothing: then only the exit codes tell."""
    assert first_failure(tmp_path, [2, 1]) == 1


def test_a_recorded_failure_beats_a_silent_one(tmp_path):
    record_failure(tmp_path, 2)  # rank 0 died without a word (killed), rank 2 recorded
    assert first_failure(tmp_path, [0, 2]) == 2


def _record_many(workdir: str, rank: int) -> None:
    for _ in range(200):
        record_failure(Path(workdir), rank)


@pytest.mark.timeout(60)
def test_records_from_many_processes_never_mix(tmp_path):
    """Each record is one append: lines from ranks failing at once stay whole."""
    # fork: the writers need no fresh interpreter (importing torch again costs seconds)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_record_many, args=(str(tmp_path), rank))
               for rank in (10, 200, 3000)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(50)
        assert writer.exitcode == 0
    lines = (tmp_path / FAILURES_FILE).read_text().split("\n")
    assert lines.pop() == ""
    assert {rank: lines.count(rank) for rank in set(lines)} == {"10": 200, "200": 200, "3000": 200}
