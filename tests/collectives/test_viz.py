"""The figures of ``ddpguide.collectives.viz``, drawn from what 3 real ranks returned.

Every panel is checked against the data: its title, its rank labels, and the
numbers written on its cells (a figure that drew the wrong tensor, or dropped
one, fails). (Named apart from tests/pipeline/test_viz.py: test basenames are
unique across folders.)
"""

from __future__ import annotations

from collections import Counter

import matplotlib
import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from ddpguide.collectives import (
    demos,  # noqa: E402
    viz,  # noqa: E402
)

WORLD = 3
PRIMITIVES = ["send/recv", "broadcast", "scatter", "gather", "reduce", "all-reduce", "all-gather",
              "reduce-scatter", "all-to-all", "barrier"]
RANKS = [f"rank {r}" for r in range(WORLD)]


def _calls(world: int) -> dict[str, tuple]:
    return {"primitives": (demos.primitives_demo,), "ring": (demos.ring_trace_demo, 1)}


@pytest.fixture(scope="module")
def per_rank(spawned):
    return spawned(WORLD)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _cell_numbers(ax) -> Counter:
    """The numbers written on the cells of a panel (labels such as 'before' left out)."""
    out = Counter()
    for text in ax.texts:
        try:
            out[float(text.get_text())] += 1
        except ValueError:
            pass
    return out


def _values(tensors) -> Counter:
    return Counter(float(v) for t in tensors for v in t.reshape(-1).tolist())


@pytest.mark.timeout(240)
def test_the_primitives_figure_draws_every_rank_before_and_after(per_rank):
    data = [r["primitives"] for r in per_rank]
    fig = viz.plot_primitives(data)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == PRIMITIVES
    for ax, name in zip(axes, PRIMITIVES):
        assert [t.get_text() for t in ax.get_yticklabels()] == RANKS, name
        if name == "barrier":
            assert len(ax.patches) == 2 * WORLD  # working and waiting, per rank
            assert "hatched: waiting in the barrier" in ax.get_xlabel()
            continue
        before = [d[name][0] for d in data]
        after = [d[name][1] for d in data]
        assert {"before", "after"} <= {t.get_text() for t in ax.texts}, name
        assert _cell_numbers(ax) == _values(before) + _values(after), name
        cells = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(cells) == sum(t.numel() for t in before + after), name
    # What all-reduce means, on the figure: every rank ends with the sums 30, 33, 36.
    all_reduce = axes[PRIMITIVES.index("all-reduce")]
    assert _cell_numbers(all_reduce) == Counter(
        {float(10 * r + i): 1 for r in range(WORLD) for i in range(WORLD)}) + Counter(
        {30.0: WORLD, 33.0: WORLD, 36.0: WORLD})
    # Cells keep their origin's colour; a sum of several ranks is grey.
    colors = {float(t.get_text()): p.get_facecolor()
              for t, p in zip([t for t in all_reduce.texts if t.get_text()[0].isdigit()],
                              [p for p in all_reduce.patches if isinstance(p, Rectangle)])}
    assert colors[21.0] == to_rgba(plt.get_cmap("tab10")(2))
    assert colors[33.0] == to_rgba(viz.MIXED)


@pytest.mark.timeout(240)
def test_the_ring_figure_has_one_panel_per_step_with_the_received_chunk_outlined(per_rank):
    states = [r["ring"] for r in per_rank]
    assert len(states[0]) == 2 * (WORLD - 1) + 1
    fig = viz.plot_ring_steps(states)
    panels = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in panels] == [
        "start", "reduce-scatter 1/2", "reduce-scatter 2/2", "all-gather 1/2", "all-gather 2/2"]
    for step, ax in enumerate(panels):
        assert [t.get_text() for t in ax.get_yticklabels()] == RANKS
        assert _cell_numbers(ax) == _values([s[step] for s in states]), step
        outlined = [p for p in ax.patches if p.get_linewidth() == 2.5]
        assert len(outlined) == (0 if step == 0 else WORLD), step  # one chunk per rank
    assert _cell_numbers(panels[-1]) == Counter({111.0: WORLD * WORLD})  # 1 + 10 + 100
    legend = [ax for ax in fig.axes if not ax.axison][0]
    assert "rank k's" in legend.texts[0].get_text()


def test_the_slider_spans_every_step_of_the_ring():
    states = [[torch.zeros(2)] * 3 for _ in range(2)]
    slider = viz.ring_step_slider(states)
    controls, image = slider.children
    (control,) = controls.children
    assert (control.description, control.min, control.max, control.value) == ("step", 0, 2, 0)
    first = bytes(image.value)
    control.value = 2
    assert first.startswith(b"\x89PNG") and bytes(image.value).startswith(b"\x89PNG")
    assert bytes(image.value) != first


def test_the_bandwidth_figure_plots_bytes_per_second_and_the_ratio_to_gloo():
    results = {1024: {"gloo": 1e-4, "ring": 2e-4}, 2 ** 20: {"gloo": 1e-3, "ring": 5e-4}}
    fig = viz.plot_bandwidth(results, world=2)
    bandwidth, relative = fig.axes
    assert bandwidth.get_title() == "all-reduce on 2 CPU ranks (gloo transport)"
    assert bandwidth.get_ylabel() == "algorithmic bandwidth, GB/s"
    assert relative.get_ylabel() == "time / gloo's time"
    assert [t.get_text() for t in bandwidth.get_xticklabels()] == ["1 KB", "1 MB"]
    lines = {line.get_label(): list(line.get_ydata()) for line in bandwidth.get_lines()}
    assert lines == {"gloo": [1024 / 1e-4 / 1e9, 2 ** 20 / 1e-3 / 1e9],
                     "ring": [1024 / 2e-4 / 1e9, 2 ** 20 / 5e-4 / 1e9]}
    ratios = {line.get_label(): list(line.get_ydata()) for line in relative.get_lines()
              if not line.get_label().startswith("_")}
    assert ratios == {"gloo": [1.0, 1.0], "ring": [2.0, 0.5]}
    assert [t.get_text() for t in relative.get_legend().get_texts()] == ["gloo", "ring"]
