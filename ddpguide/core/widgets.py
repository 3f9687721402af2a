"""The chapters' live widgets: controls that redraw a figure or a table on every change.

:func:`live` shows what its ``render`` returns in an ipywidgets ``Image`` (a figure, as PNG)
and an ``HTML`` (text), never in an ``Output`` widget. nbclient, which runs the chapters for
``pytest --nbmake`` and ``jupyter-book``, answers every output that an ``Output`` widget
captures with a ``comm_msg`` on the kernel's shell socket, from the task that reads IOPub, while
another task polls that socket for the cell's reply. Under load that poll can miss the reply
and wait out the cell's whole timeout before it reads it and goes on without an error
(jupyter/nbclient#312). An ``Image`` or ``HTML`` widget's new value goes out from the kernel
and nothing is sent back.
"""

from __future__ import annotations

import html
import io
import traceback
from typing import Any, Callable


def png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (closed afterwards, so it is not also shown inline)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def live(render: Callable[..., Any], controls: dict[str, Any], arrange: Any = None) -> Any:
    """``controls`` (name -> ipywidgets control) above what ``render(**values)`` returns.

    ``render`` returns a matplotlib figure, a string of HTML, or a tuple of both (the HTML
    above the figure). The panel holds the controls and only the parts the latest drawing
    has (an ``Image`` with no picture would be a broken image in the HTML book). ``render``
    runs once here, so an error in the first drawing raises in the cell; an error in a later
    one is shown in place of the drawing. ``arrange`` is a box holding the controls in
    another layout (default: one above the other).
    """
    import ipywidgets as widgets

    for control in controls.values():  # each label in full ("micro-batches m", not "micro-bat...")
        if hasattr(getattr(control, "style", None), "description_width"):
            control.style.description_width = "initial"
    box = arrange if arrange is not None else widgets.VBox(list(controls.values()))
    # flex-start: a picture at its own width (narrowed to the page's, never widened to it)
    image = widgets.Image(format="png", layout=widgets.Layout(align_self="flex-start"))
    note, panel = widgets.HTML(), widgets.VBox([box])

    def show(drawing: Any) -> None:
        parts = drawing if isinstance(drawing, tuple) else (drawing,)
        texts = [p for p in parts if isinstance(p, str) and p]
        figures = [p for p in parts if p is not None and not isinstance(p, str)]
        note.value = "".join(texts)
        if figures:
            image.value = png(figures[0])
        panel.children = [box] + ([note] if texts else []) + ([image] if figures else [])

    def values() -> dict[str, Any]:
        return {name: control.value for name, control in controls.items()}

    def redraw(_change: Any = None) -> None:
        try:
            show(render(**values()))
        except Exception:  # a live change: say it where the drawing was
            show(f"<pre>{html.escape(traceback.format_exc(limit=3))}</pre>")

    show(render(**values()))
    for control in controls.values():
        control.observe(redraw, names="value")
    return panel
