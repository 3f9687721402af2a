"""The chapters' live widgets: what ``live`` draws, how it redraws, and that no widget of the
package captures output in an ``Output`` widget (the reason is in ``ddpguide.core.widgets``)."""

from __future__ import annotations

import re
from pathlib import Path

import ipywidgets as widgets
import matplotlib.pyplot as plt
import pytest

from ddpguide.core.widgets import live, png

PACKAGE = Path(__file__).resolve().parents[2] / "ddpguide"
PNG = b"\x89PNG\r\n\x1a\n"


def _line(n: int):
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot(range(n))
    return fig


def test_a_figure_is_shown_as_png_and_drawn_again_on_every_change():
    calls, figures = [], []

    def render(n: int, label: str):
        calls.append((n, label))
        figures.append(_line(n))
        return figures[-1]

    n, label = widgets.IntSlider(value=3, min=2, max=9), widgets.Text(value="a")
    panel = live(render, {"n": n, "label": label})
    controls, image = panel.children
    assert controls.children == (n, label) and calls == [(3, "a")]
    assert n.style.description_width == label.style.description_width == "initial"  # labels in full
    assert isinstance(image, widgets.Image) and bytes(image.value).startswith(PNG)
    first = bytes(image.value)
    n.value = 7
    label.value = "b"
    assert calls == [(3, "a"), (7, "a"), (7, "b")] and panel.children == (controls, image)
    assert bytes(image.value).startswith(PNG) and bytes(image.value) != first
    # each figure closed once drawn: nothing left for the inline backend to show again
    assert len(figures) == 3 and not any(plt.fignum_exists(f.number) for f in figures)


def test_html_a_tuple_and_an_arrangement():
    n = widgets.IntSlider(value=2)
    box = widgets.HBox([n])
    panel = live(lambda n: f"<b>{n}</b>" if n < 5 else ("<p>both</p>", _line(n)), {"n": n}, box)
    controls, note = panel.children  # no image: an empty one is a broken picture in the HTML book
    assert controls is box and isinstance(note, widgets.HTML) and note.value == "<b>2</b>"
    n.value = 6
    assert panel.children[:2] == (box, note) and note.value == "<p>both</p>"
    assert bytes(panel.children[2].value).startswith(PNG)
    n.value = 3
    assert panel.children == (box, note) and note.value == "<b>3</b>"


def test_an_error_raises_in_the_first_drawing_and_is_shown_in_a_later_one():
    def render(n: int):
        if n > 4:
            raise ValueError(f"n = {n} > 4 & too big")
        return _line(n)

    with pytest.raises(ValueError, match="n = 5 > 4"):
        live(render, {"n": widgets.IntSlider(value=5)})
    n = widgets.IntSlider(value=3)
    panel = live(render, {"n": n})
    controls, image = panel.children
    n.value = 6
    (_, note) = panel.children
    assert note.value.startswith("<pre>") and "ValueError: n = 6 &gt; 4 &amp; too big" in note.value
    n.value = 2
    assert panel.children == (controls, image) and bytes(image.value).startswith(PNG)


def test_png_closes_the_figure():
    fig = _line(2)
    assert png(fig).startswith(PNG) and not plt.fignum_exists(fig.number)


def test_no_widget_of_the_package_captures_output():
    capture = re.compile(r"widgets\.(Output|interactive|interact|interactive_output)\b|@interact\b")
    found = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "widgets.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if capture.search(line)]
    assert found == [], "draw through ddpguide.core.widgets.live (an Image or HTML widget):\n" + "\n".join(found)
