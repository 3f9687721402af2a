"""The chapter's layout explorer: the ranked layouts and a memory bar per component.

:func:`explorer` is an ipywidgets form (model, GPUs, GPUs a node, hardware, sequence,
batch) that recomputes in JupyterLab; :func:`static_html` is the same table and bars for a
fixed list of cases, plain HTML that the HTML book shows without a kernel.
"""

from __future__ import annotations

import html
from types import ModuleType
from typing import Any

from ddpguide.plan import catalog, published, search
from ddpguide.plan.hardware import named

COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
           "activations": "#c44e52", "fsdp_unsharded": "#8172b3", "communication": "#937860",
           "temporaries": "#da8bc3", "outputs": "#ccb974"}


def _bar(memory: dict[str, float], limit: float, width: int = 260) -> str:
    """One rank's memory as stacked coloured segments against the limit (the bar's width)."""
    total = sum(memory.values())
    scale = width / max(limit, total)
    cells = "".join(f'<span title="{html.escape(k)}: {v / 2**30:.3g} GiB" style="display:inline-block;'
                    f'height:12px;width:{max(v * scale, 0):.1f}px;background:{COLOURS[k]}"></span>'
                    for k, v in memory.items() if v > 0)
    limit_mark = f'<span style="display:inline-block;width:0;height:14px;border-left:2px solid black;' \
                 f'margin-left:{max(0.0, limit * scale - total * scale):.1f}px"></span>'
    return f'<span style="white-space:nowrap">{cells}{limit_mark}</span>'


def ranked_html(rows: list[dict[str, Any]], hw: Any, top: int = 8) -> str:
    """A table of the best ``top`` layouts: memory bar, step and its parts, tokens/s, MFU."""
    head = ("layout", "memory a GPU (GiB)", "", "step (s)", "compute", "exposed comm.", "tokens/s a GPU", "MFU")
    out = ['<table style="font-size:0.85em"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in rows[:top]:
        worst = max(r["at_peak"], key=lambda m: sum(m.values()))
        s = r["step"]
        cells = (html.escape(r["name"]) + ("" if r["fits"] else " (too big)"),
                 f"{r['peak_memory'] * r['headroom'] / 2**30:.3g} of {hw.memory / 2**30:.3g}", _bar(worst, hw.memory),
                 f"{s['total']:.4g}", f"{s['compute']:.3g}", f"{s['tp_cp_ep_pp'] + s['data_parallel'] + s['sync']:.3g}",
                 f"{r['tokens_per_gpu']:.4g}", f"{r['mfu']:.1%}")
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {k}' for k, c in COLOURS.items())
    return "".join(out) + f"</table><div style='font-size:0.8em'>{legend}; the black mark: the GPU's memory</div>"


def case(p: ModuleType, model: str, gpus: int, hardware: str, seq: int, batch: int, gpus_per_node: int = 0,
         dtype: str = "bf16", hw: Any = None) -> tuple[list[dict[str, Any]], Any]:
    """The ranked rows of one case (``hw``: a measured ``Hardware`` instead of a named one)."""
    hw = hw or named(p, hardware)
    if gpus_per_node:
        hw.gpus_per_node = gpus_per_node
    rows = search.rank(p, catalog.model(p, model), catalog.policy(p, dtype), hw, gpus, batch, seq,
                       headroom=published.headroom(p))
    return rows, hw


def static_html(p: ModuleType, cases: list[tuple[str, int, str, int, int]], top: int = 5) -> str:
    """Each case ``(model, gpus, hardware, seq, global batch)``: a heading and its table."""
    parts = []
    for model, gpus, hardware, seq, batch in cases:
        rows, hw = case(p, model, gpus, hardware, seq, batch)
        fits = sum(r["fits"] for r in rows)
        parts.append(f"<h4>{html.escape(model)} on {gpus} x {hardware}, sequence {seq}, batch {batch}: "
                     f"{len(rows)} layouts, {fits} fit</h4>" + ranked_html(rows, hw, top))
    return "".join(parts)


def explorer(p: ModuleType) -> Any:
    """The form, live in JupyterLab: every change ranks the layouts again."""
    import ipywidgets as widgets

    from ddpguide.core.widgets import live

    def draw(model: str, gpus: int, hardware: str, seq: int, batch: int) -> str:
        rows, hw = case(p, model, gpus, hardware, seq, batch)
        return ranked_html(rows, hw)

    return live(draw, {
        "model": widgets.Dropdown(options=[m for m in catalog.MODELS if not m.startswith("gpt")], value="llama3-8b",
                                  description="model"),
        "gpus": widgets.Dropdown(options=[8, 16, 32, 64, 128], value=8, description="gpus"),
        "hardware": widgets.Dropdown(options=list(catalog.HARDWARE), value="H100", description="hardware"),
        "seq": widgets.Dropdown(options=[2048, 4096, 8192, 32768], value=8192, description="seq"),
        "batch": widgets.Dropdown(options=[8, 16, 32, 64, 128, 256], value=16, description="global batch"),
    })
