"""The schedule visualiser: grids that obey the dependencies, the bubble formula, memory."""

from __future__ import annotations

from fractions import Fraction

import matplotlib
import numpy as np
import pytest

from ddpguide.pipeline import viz as sv

matplotlib.use("Agg")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("costs", [(1, 1), (1, 2), (2, 3)])
def test_idle_cells_match_the_bubble_formula(schedule, costs):
    for p in range(1, 6):
        for m in range(1, 10):
            tl = sv.simulate(schedule, p, m, *costs)
            idle = sum(1 for cell in tl.grid.flat if cell == "")
            assert Fraction(idle, tl.grid.size) == sv.bubble_fraction(p, m), (p, m)
            assert tl.idle_fraction == Fraction(p - 1, m + p - 1)
            # every stage is busy for exactly m forwards and m backwards
            busy = (tl.grid != "").sum(axis=1)
            assert (busy == m * sum(costs)).all()


def test_gpipe_grid_for_two_stages():
    tl = sv.simulate("gpipe", 2, 3, forward_cost=1, backward_cost=1)
    assert tl.grid.tolist() == [
        ["F0", "F1", "F2", "", "", "B0", "B1", "B2"],
        ["", "F0", "F1", "F2", "B0", "B1", "B2", ""],
    ]
    assert tl.makespan == 2 * (3 + 2 - 1)


def test_1f1b_grid_for_three_stages():
    tl = sv.simulate("1f1b", 3, 4, forward_cost=1, backward_cost=1)
    rows = [" ".join(cell or "." for cell in row) for row in tl.grid]
    assert rows == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3 .",
        ". . F0 B0 F1 B1 F2 B2 F3 B3 . .",
    ]
    assert tl.makespan == 2 * (4 + 3 - 1)


def spans(tl, op):
    """(stage, start, end) of each occurrence of ``op`` in the grid."""
    out = []
    for s, row in enumerate(tl.grid):
        t = [i for i, cell in enumerate(row) if cell == op]
        if t:
            out.append((s, t[0], t[-1] + 1))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_operation_waits_for_its_inputs(schedule):
    p, m = 4, 6
    tl = sv.simulate(schedule, p, m, 1, 2)
    for i in range(m):
        f = {s: (start, end) for s, start, end in spans(tl, f"F{i}")}
        b = {s: (start, end) for s, start, end in spans(tl, f"B{i}")}
        assert sorted(f) == sorted(b) == list(range(p))
        for s in range(1, p):
            assert f[s][0] >= f[s - 1][1]          # forward needs the previous stage's output
        for s in range(p - 1):
            assert b[s][0] >= b[s + 1][1]          # backward needs the next stage's gradient
        assert b[p - 1][0] >= f[p - 1][1]          # the loss needs the last forward


def test_memory_gpipe_holds_m_and_1f1b_holds_p_minus_s():
    for p in range(1, 6):
        for m in range(1, 10):
            assert sv.simulate("gpipe", p, m).in_flight == [m] * p
            assert sv.simulate("1f1b", p, m).in_flight == [min(m, p - s) for s in range(p)]


def test_stage_orders():
    assert sv.stage_order("gpipe", 2, 2, 0) == ["F0", "F1", "B0", "B1"]
    assert sv.stage_order("1f1b", 2, 4, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert sv.stage_order("1f1b", 2, 4, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # with fewer micro-batches than stages, 1F1B degenerates into GPipe
    assert sv.stage_order("1f1b", 4, 2, 0) == sv.stage_order("gpipe", 4, 2, 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="^unknown schedule 'zb': choose one of gpipe, 1f1b$"):
        sv.stage_order("zb", 2, 2, 0)
    with pytest.raises(ValueError, match="^need at least one stage and one micro-batch, got p=0, m=4$"):
        sv.bubble_fraction(0, 4)
    with pytest.raises(ValueError, match="^operation costs must be at least one time unit$"):
        sv.simulate("gpipe", 2, 2, forward_cost=0)


def test_static_figure_shows_both_schedules():
    import matplotlib.pyplot as plt

    fig = sv.plot_schedules(stages=3, microbatches=5)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2
    assert titles[0].startswith("GPipe: p=3, m=5, idle 29%") and "holds 5 micro-batches" in titles[0]
    assert titles[1].startswith("1F1B: p=3, m=5, idle 29%") and "holds 3 micro-batches" in titles[1]
    image = fig.axes[0].get_images()[0].get_array()
    white = np.all(np.asarray(image) == 1.0, axis=-1)
    assert white.sum() == sv.simulate("gpipe", 3, 5).idle_cells
    plt.close(fig)


def test_widget_has_three_sliders():
    widget = sv.schedule_widget(stages=3, microbatches=5)
    sliders = {c.description: c.value for c in widget.children[:-1]}
    assert sliders == {"stages p": 3, "micro-batches m": 5, "backward cost": 2}
