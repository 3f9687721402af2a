"""Pictures of SBP: which block of the logical tensor each rank holds.

:func:`draw_layout` is a static matplotlib figure (what the HTML book shows);
:func:`explorer` wraps it in ipywidgets so that, in JupyterLab, the mesh shape,
the tensor shape and the SBP of each mesh dimension can be changed live.
Both work from :func:`ddpguide.sbp.placements.local_regions`, the same ``torch.chunk``
arithmetic DTensor uses (the tests compare the two), so no processes are needed.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ddpguide.sbp.placements import SBPLike, as_placements, sbp_names
from ddpguide.sbp.regions import local_regions, mesh_coordinates

MESH_CHOICES = {"1D: 2 ranks": (2,), "1D: 4 ranks": (4,), "2D: 2 x 2": (2, 2),
                "2D: 1 x 4": (1, 4), "2D: 4 x 1": (4, 1)}
SBP_CHOICES = ("B", "S(0)", "S(1)", "P")


def _rank_colour(rank: int, alpha: float = 1.0):
    return plt.get_cmap("tab10")(rank % 10, alpha=alpha)


def draw_layout(shape: Sequence[int] = (4, 6), mesh_shape: Sequence[int] = (2, 2),
                sbp: SBPLike = ("B", "S(0)"), figure: Figure | None = None,
                values: Sequence[Sequence[float]] | None = None) -> Figure:
    """One panel per rank, laid out like the mesh, showing its block of the logical tensor.

    Cells a rank holds are filled with its colour and labelled with the logical
    tensor's ``values`` (default: the flat index); hatched cells hold a
    *partial* value (a summand).
    """
    if len(shape) != 2:
        raise ValueError(f"draw_layout shows 2D tensors, got shape {tuple(shape)}")
    mesh_shape = tuple(mesh_shape)
    placements = as_placements(sbp, len(mesh_shape))
    regions = local_regions(shape, mesh_shape, placements)
    grid_rows, grid_cols = (1, mesh_shape[0]) if len(mesh_shape) == 1 else mesh_shape
    fig = figure or plt.figure()
    fig.clear()
    fig.set_size_inches(1.0 + 2.1 * grid_cols, 0.8 + 2.2 * grid_rows)
    axes = fig.subplots(grid_rows, grid_cols, squeeze=False)
    rows, cols = shape
    for rank, coord in enumerate(mesh_coordinates(mesh_shape)):
        ax = axes[coord[0], coord[1]] if len(coord) == 2 else axes[0, coord[0]]
        region = regions[coord]
        (r0, r1), (c0, c1) = region.bounds
        for r in range(rows):
            for c in range(cols):
                held = r0 <= r < r1 and c0 <= c < c1
                ax.add_patch(Rectangle(
                    (c, rows - 1 - r), 1, 1, edgecolor="white", linewidth=1,
                    facecolor=_rank_colour(rank, 0.45 if region.partial else 1.0) if held
                    else (0.92, 0.92, 0.92),
                    hatch="///" if held and region.partial else None,
                ))
                if held and rows * cols <= 64:
                    label = f"{float(values[r][c]):g}" if values is not None else str(r * cols + c)
                    ax.text(c + 0.5, rows - 0.5 - r, label, ha="center", va="center",
                            fontsize=7, color="white" if not region.partial else "black")
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        where = f"{coord}" if len(coord) > 1 else f"({coord[0]})"
        note = "  partial" if region.partial else ""
        ax.set_title(f"rank {rank} {where}\nlocal {region.shape}{note}", fontsize=8)
    fig.suptitle(f"logical {tuple(shape)} on mesh {mesh_shape} as {sbp_names(placements)}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def explorer(shape: Sequence[int] = (4, 6), mesh: str = "2D: 2 x 2",
             sbp: Sequence[str] = ("B", "S(0)")):
    """An ipywidgets panel around :func:`draw_layout` (live in JupyterLab)."""
    import ipywidgets as widgets

    from ddpguide.core.widgets import live

    controls = {"mesh": widgets.Dropdown(options=list(MESH_CHOICES), value=mesh, description="mesh"),
                "rows": widgets.IntSlider(value=shape[0], min=1, max=8, description="rows"),
                "cols": widgets.IntSlider(value=shape[1], min=1, max=8, description="columns")}
    dims = [widgets.Dropdown(options=SBP_CHOICES, value=s, description=f"mesh dim {i}")
            for i, s in enumerate(sbp)]
    controls.update({f"dim{i}": d for i, d in enumerate(dims)})

    def redraw(mesh: str, rows: int, cols: int, **placements: str):
        mesh_shape = MESH_CHOICES[mesh]
        dims[1].disabled = len(mesh_shape) == 1
        return draw_layout((rows, cols), mesh_shape, list(placements.values())[: len(mesh_shape)])

    arrange = widgets.VBox([controls["mesh"], widgets.HBox([controls["rows"], controls["cols"]]),
                            widgets.HBox(dims)])
    return live(redraw, controls, arrange)
