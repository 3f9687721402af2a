"""Event files: whole JSON lines from many writers; a line still being written waits."""

from __future__ import annotations

import json
import os

from ddpguide.elastic.events import EventTail, EventWriter


def test_events_round_trip_from_two_writers(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.poll() == []  # no file yet
    a = EventWriter(path, node="A", rank=0)
    b = EventWriter(path, node="B", rank=1)
    a.write("start", epoch=0)
    b.write("spawned", pid=123)
    a.write("epoch", epoch=0, loss=0.5)
    events = tail.poll()
    assert [(e["event"], e["node"], e["rank"]) for e in events] == [
        ("start", "A", 0), ("spawned", "B", 1), ("epoch", "A", 0)]
    assert events[2]["loss"] == 0.5 and events[1]["pid"] == 123
    assert events[0]["t"] <= events[1]["t"] <= events[2]["t"]  # one monotonic clock
    assert tail.poll() == []  # each line is read once
    a.close()
    b.close()


def test_a_torn_last_line_waits_for_its_end(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path, node="A")
    tail = EventTail(path)
    writer.write("first_step")
    line = json.dumps({"t": 1.0, "event": "epoch", "epoch": 3}) + "\n"
    with open(path, "ab") as f:  # a writer caught in the middle of its line
        f.write(line[:10].encode())
    assert [e["event"] for e in tail.poll()] == ["first_step"]
    assert tail.poll() == []
    with open(path, "ab") as f:
        f.write(line[10:].encode())
    assert tail.poll() == [{"t": 1.0, "event": "epoch", "epoch": 3}]
    writer.close()
    assert os.path.getsize(path) == len(path.read_bytes())
