"""The timeline figure: world size over time, a marked span per recovery, epochs by size."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from ddpguide.elastic.plot import CAUSE_COLORS, plot_timeline


def _report() -> dict:
    events = [
        {"time_s": 0.0, "event": "action"},
        {"time_s": 2.0, "event": "first_step", "world_size": 2},
        {"time_s": 5.0, "event": "join"},
        {"time_s": 7.5, "event": "first_step", "world_size": 4},
        {"time_s": 10.0, "event": "crash"},
        {"time_s": 13.0, "event": "first_step", "world_size": 2},
        {"time_s": 16.0, "event": "finished"},
    ]
    return {
        "events": events,
        "duration_s": 17.0,
        "recoveries": [{"cause": "join", "seconds": 2.5}, {"cause": "crash", "seconds": 3.0}],
        "epochs": [{"epoch": 0, "world_size": 2, "time_s": 4.0},
                   {"epoch": 1, "world_size": 4, "time_s": 9.0},
                   {"epoch": 2, "world_size": 2, "time_s": 15.0}],
        "groups": [{"time_s": 1.0, "start_epoch": 0, "restart": 0},
                   {"time_s": 6.0, "start_epoch": 1, "restart": 0},
                   {"time_s": 11.0, "start_epoch": 2, "restart": 1}],
    }


def test_timeline_has_the_world_size_steps_recoveries_and_epochs():
    fig = plot_timeline(_report())
    try:
        top, bottom = fig.axes[:2]
        size_line = top.lines[0]
        assert list(size_line.get_xdata()) == [0.0, 2.0, 5.0, 7.5, 10.0, 13.0, 16.0, 17.0]
        assert list(size_line.get_ydata()) == [0, 2, 0, 4, 0, 2, 0, 0]
        assert size_line.get_drawstyle() == "steps-post"
        # One dashed line per disturbance on each panel, in its cause's colour.
        for axis in (top, bottom):
            marks = [ln for ln in axis.lines if ln.get_linestyle() == "--"]
            assert [ln.get_xdata()[0] for ln in marks] == [5.0, 10.0]
            assert [ln.get_color() for ln in marks] == [CAUSE_COLORS["join"], CAUSE_COLORS["crash"]]
        texts = [t.get_text() for t in top.texts]
        assert texts == ["join\n2.5 s", "crash\n3.0 s"]
        assert [t.get_text() for t in bottom.texts] == [
            "start 0\nrestart 0", "start 1\nrestart 0", "start 2\nrestart 1"]
        labels = [t.get_text() for t in bottom.get_legend().get_texts()]
        assert labels == ["epoch finished, world size 2", "epoch finished, world size 4"]
        assert top.get_ylabel() == "world size\n(training)"
        assert bottom.get_xlabel() == "seconds since node A started"
        assert bottom.get_ylabel() == "epoch"
    finally:
        plt.close(fig)


def test_timeline_draws_into_given_axes():
    fig, axes = plt.subplots(2, 1)
    try:
        assert plot_timeline(_report(), ax=axes) is fig
    finally:
        plt.close(fig)
