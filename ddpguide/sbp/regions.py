"""Who holds what: the block of a logical tensor that each mesh coordinate holds.

Pure functions, no process group: figures and boxing plans can be drawn
anywhere, and the tests check them against DTensor's own local shards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import Placement

from ddpguide.sbp.placements import SBPLike, as_placements, check_sbp


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` cuts ``size`` into ``parts``.

    ``torch.chunk`` uses chunks of ``ceil(size / parts)``; the last ones may be
    shorter or empty: 6 over 4 gives 2, 2, 2, 0 (not 2, 2, 1, 1).
    """
    full = -(-size // parts)
    start = min(index * full, size)
    return start, min(start + full, size)


@dataclass(frozen=True)
class Region:
    """The part of the logical tensor one rank holds."""

    bounds: tuple[tuple[int, int], ...]
    partial: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.bounds)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.bounds)


def mesh_coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Mesh coordinates in rank order (row-major, as ``init_device_mesh`` lays them out)."""
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def logical_shapes(shape: Sequence[int], mesh_shape: Sequence[int],
                   placements: Sequence[Placement], coord: Sequence[int]) -> list[tuple[int, ...]]:
    """The shape each mesh dimension sees at ``coord``, after the dims before it have split.

    Mesh dimensions apply left to right: in ``(S(0), S(0))`` the second split
    cuts the piece that the first one left on this rank.
    """
    current = list(shape)
    seen = []
    for mesh_dim, placement in enumerate(placements):
        seen.append(tuple(current))
        if isinstance(placement, Shard):
            start, stop = chunk_bounds(current[placement.dim], mesh_shape[mesh_dim], coord[mesh_dim])
            current[placement.dim] = stop - start
    return seen


def local_regions(shape: Sequence[int], mesh_shape: Sequence[int],
                  sbp: SBPLike) -> dict[tuple[int, ...], Region]:
    """For every mesh coordinate, which block of the logical tensor that rank holds."""
    placements = check_sbp(shape, as_placements(sbp, len(mesh_shape)))
    regions = {}
    for coord in mesh_coordinates(mesh_shape):
        bounds = [(0, size) for size in shape]
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                lo, hi = bounds[placement.dim]
                start, stop = chunk_bounds(hi - lo, mesh_shape[mesh_dim], coord[mesh_dim])
                bounds[placement.dim] = (lo + start, lo + stop)
        partial = any(isinstance(p, Partial) for p in placements)
        regions[coord] = Region(tuple(bounds), partial)
    return regions
