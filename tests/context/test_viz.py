"""The chapter's figures: log-log memory, bars of work per rank."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from ddpguide.context.program import work_per_rank  # noqa: E402
from ddpguide.context.viz import plot_memory, plot_work  # noqa: E402


def test_memory_figure_is_log_log_with_one_line_per_world():
    fig = plot_memory([256, 512], {1: [4e6, 16e6], 2: [1e6, 4e6]})
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "1 process, full attention", "ring attention, 2 ranks"]


def test_work_figure_has_a_bar_per_rank_and_split():
    fig = plot_work({"contiguous": work_per_rank(4, "contiguous"),
                     "zig-zag": work_per_rank(4, "zigzag")})
    assert len(fig.axes[0].patches) == 8
