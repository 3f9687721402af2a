"""ddpguide.elastic.progress: the demo's bar over the epochs on stderr."""

from __future__ import annotations

import io

from ddpguide.elastic.progress import EpochBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _epoch(epoch: int, world_size: int, rank: int = 0) -> dict:
    return {"event": "epoch", "epoch": epoch, "world_size": world_size, "rank": rank}


def test_the_bar_counts_each_finished_epoch_once_and_names_the_world_size():
    err, out = Terminal(), io.StringIO()
    with EpochBar(14, stream=err, out=out) as bar:
        bar.event({"event": "start", "epoch": 0, "world_size": 2, "rank": 0})
        for epoch, world_size in ((0, 2), (1, 2), (2, 4), (2, 4)):  # epoch 2 twice: counted once
            bar.event(_epoch(epoch, world_size))
        bar.event(_epoch(3, 4, rank=1))  # not rank 0: not counted
        bar.echo("   5.0 s  node B joins with 2 workers")
        assert bar.done == {0, 1, 2}
        bar.bar.refresh()
    drawn = err.getvalue()
    assert "epochs" in drawn and "3/14" in drawn and "world size 4" in drawn
    assert "a group of 2 starts at epoch 0" in drawn
    assert out.getvalue() == "   5.0 s  node B joins with 2 workers\n"  # the timeline, on stdout


def test_without_a_terminal_only_the_timeline_is_printed():
    err, out = io.StringIO(), io.StringIO()  # a pipe or a log file: no bar
    with EpochBar(14, stream=err, out=out) as bar:
        bar.event(_epoch(0, 2))
        bar.echo("   1.0 s  epoch 0 done at world size 2")
    assert err.getvalue() == ""
    assert out.getvalue() == "   1.0 s  epoch 0 done at world size 2\n"
