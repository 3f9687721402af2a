"""pipeline.viz: the figures draw the simulator's timelines, and their titles give its bubble."""

from __future__ import annotations

import matplotlib
import numpy as np

from ddpguide.pipeline import viz, zoo
from ddpguide.pipeline.timeline import Costs

matplotlib.use("Agg")


def test_static_figure_shows_both_schedules():
    import matplotlib.pyplot as plt

    fig = viz.plot_schedules(stages=3, microbatches=5)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2
    # bubble = idle over busy: (p - 1)(F + B) per stage over m (F + B), 2/5
    assert titles[0].startswith("GPipe: p=3, m=5, bubble 18/45 = 40% (formula (p-1)/m = 40%)")
    assert titles[0].endswith("stage 0 holds 5 micro-batches")
    assert titles[1].startswith("1F1B: p=3, m=5, bubble 18/45 = 40%") and "holds 3 micro-batches" in titles[1]
    image = fig.axes[0].get_images()[0].get_array()
    white = np.all(np.asarray(image) == 1.0, axis=-1)
    assert white.sum() == zoo.simulate("GPipe", 3, 5, Costs(F=1, B=2)).idle == 18
    plt.close(fig)


def test_widget_has_three_sliders_and_names_a_refusal():
    widget = viz.schedule_widget(stages=3, microbatches=5)
    controls, image = widget.children  # nothing refused: no note
    sliders = {c.description: c.value for c in controls.children}
    assert sliders == {"stages p": 3, "micro-batches m": 5, "backward cost": 2}
    assert bytes(image.value).startswith(b"\x89PNG")
    both = bytes(image.value)

    controls.children[1].value = 2  # m = 2 < p = 3: the library's 1F1B refuses it
    _, note, image = widget.children
    assert note.value == ("<p>1F1B: Number of microbatches (2) must be greater than or equal to the "
                          "number of stages (3).</p>")
    assert bytes(image.value).startswith(b"\x89PNG") and bytes(image.value) != both  # GPipe alone


def test_timeline_figure_titles_carry_the_counts():
    import matplotlib.pyplot as plt

    fig = viz.plot_action_timelines(2, 4, ["1F1B", "ZBVZeroBubble"])
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    plt.close(fig)
    assert titles == ["1F1B: idle/compute 6/24 = 0.250 (formula 1/4 = 0.250)",
                      "ZBVZeroBubble: idle/compute 2/48 = 0.042 (formula 1/24 = 0.042)"]
    fig = viz.plot_action_timelines(2, 4, ["ZBVZeroBubble"], costs=Costs(2, 2, 1))
    title = fig.axes[0].get_title(loc="left")
    plt.close(fig)
    assert title == "ZBVZeroBubble: idle/compute 4/80 = 0.050 (F=2, I=2, W=1, B=3)"  # (p - 1) F per rank
