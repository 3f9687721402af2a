"""A rank's side of the runner's first-failure rule (``ddpguide.launch.rank_files``, which
``ddpguide.launch.child`` calls): failures recorded with a time stamp, read earliest first."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from ddpguide.launch.rank_files import FAILURES_VARIABLE, record_failure, recorded_failures, worker_errors


def test_the_earliest_time_stamp_comes_first_whatever_the_order_of_the_lines(tmp_path):
    path = tmp_path / "failures.txt"
    path.write_text(f"{time.time() + 5:.6f} 3\n")  # a line written first, stamped later
    record_failure(0, path)
    record_failure(1, path)
    assert recorded_failures(path) == [0, 1, 3]
    assert recorded_failures(tmp_path / "none.txt") == []


def test_a_rank_records_into_the_file_its_group_named_and_nowhere_without_one(tmp_path, monkeypatch):
    monkeypatch.setenv(FAILURES_VARIABLE, str(tmp_path / "group.txt"))
    record_failure(2)
    assert recorded_failures(tmp_path / "group.txt") == [2]
    monkeypatch.delenv(FAILURES_VARIABLE)
    record_failure(4)  # a program run outside a group: nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["group.txt"]


def _record_many(path: str, rank: int) -> None:
    for _ in range(200):
        record_failure(rank, path)


@pytest.mark.timeout(60)
def test_records_from_many_processes_never_mix(tmp_path):
    """Each record is one append: lines from ranks failing at once stay whole."""
    # fork: the writers need no fresh interpreter (importing torch again costs seconds)
    context = multiprocessing.get_context("fork")
    path = tmp_path / "failures.txt"
    writers = [context.Process(target=_record_many, args=(str(path), rank))
               for rank in (10, 200, 3000)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(50)
        assert writer.exitcode == 0
    found = recorded_failures(path)
    assert {rank: found.count(rank) for rank in set(found)} == {10: 200, 200: 200, 3000: 200}
    assert len(Path(path).read_text().splitlines()) == 600


def _raise_under_record(error_file: Path, error: Exception, monkeypatch) -> None:
    """What a worker's ``@record`` main writes when it raises ``error`` (torch's own writer)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def main() -> None:
        raise error
    with pytest.raises(type(error)):
        main()


def test_the_workers_errors_are_read_from_their_error_files_earliest_attempt_first(tmp_path, monkeypatch):
    run = tmp_path / "logs" / "job_abc"
    _raise_under_record(run / "attempt_1" / "0" / "error.json", RuntimeError("second attempt"), monkeypatch)
    _raise_under_record(run / "attempt_0" / "0" / "error.json", ValueError("timed out"), monkeypatch)
    _raise_under_record(run / "attempt_0" / "1" / "error.json",
                        RuntimeError("[pair.cc:534] Connection closed by peer\nException raised from"), monkeypatch)
    (run / "attempt_0" / "2").mkdir()  # a worker stopped by a signal writes none
    assert worker_errors(tmp_path / "logs") == [
        "ValueError: timed out", "RuntimeError: [pair.cc:534] Connection closed by peer",
        "RuntimeError: second attempt"]
    later = run / "attempt_0" / "0" / "error.json"  # local rank 0 raised 10 s after local rank 1
    data = json.loads(later.read_text())
    data["message"]["extraInfo"]["timestamp"] = str(int(data["message"]["extraInfo"]["timestamp"]) + 10)
    later.write_text(json.dumps(data))
    assert worker_errors(tmp_path / "logs")[:2] == [
        "RuntimeError: [pair.cc:534] Connection closed by peer", "ValueError: timed out"]
    assert worker_errors(tmp_path / "no logs") == []
