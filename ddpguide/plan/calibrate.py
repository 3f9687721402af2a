"""A layout's compute rate measured in its own ranks, beside its steps, for its prediction.

The matmul table and the cores (``plan_measure.py --measure``) are timed before the runs they
serve, in processes of their own. On a loaded machine the rate a matmul gets moves 2-4x within
a minute, and the cores several busy processes get move with it (tables a minute and a half
apart read 0.95 and 0.44 cores for four ranks): a table timed then can be far from what a run gets.

``train.py --cost --rate-window S`` measures it in the run's own processes instead, with a
matmul of the run's MLP's shape (``rows x dim`` by ``dim x ffn``, as ``cost_meter.matmul_peak``
times it), in windows of S seconds of whole matmuls. After the model is built the ranks take
turns, one computing while the others wait in a barrier (``cost_meter.alone_rate``):
``alone_flops``, the rate of one rank alone, the ranks' mean, as the table's rates are of one
process alone. Before each step, outside the step's clock, all ranks start together and run the
matmul for S seconds (``cost_meter.shared_rate``): ``shared_flops`` is the rate of all ranks
together, each at the slowest rank's rate (a step waits for its slowest rank; on a loaded
machine the ranks' shares differ 2-3x within a window), in the windows before the timed steps
(their median): what the ranks get while all of them compute, at the time the steps run. Both
are timed in the run's processes, within seconds of its steps (the table: half a minute to a
minute before them), with nothing but the matmul running. The steps are never timed for it and
their time is never read here: each window is a matmul of known FLOPs between two steps, a
microbenchmark as the table's are, so the prediction is made from the machine's rate at that
time, not fitted to the step it predicts.

:func:`beside` scales every rate of the table by one rank's rate alone over the table's rate
for the same shape, and sets ``Hardware.cores`` to the ranks' rate together over one rank's
alone (the simulation shares the cores among busy ranks as before: all ranks computing get
``shared_flops`` together). The result is the hardware for that one layout's prediction.
"""

from __future__ import annotations

import copy
from typing import Any


def shape(model: Any, layout: Any, batch: int, seq: int) -> tuple[int, int, int]:
    """The (m, k, n) of the matmul ``train.py --cost`` times: a rank's rows (its share of the
    batch of one accumulation step, its chunk of the sequence) by the width, and the width by
    the MLP's."""
    return batch // layout.accumulate // layout.data_parallel * seq // layout.cp, model.dim, model.ffn


def rate(layout: Any, record: dict[str, Any]) -> float:
    """FLOP/s of one rank computing alone (``alone_flops``), or its share of what all ranks got
    together (``shared_flops``) where that is more (a machine whose load fell between the two)."""
    return max(float(record["alone_flops"]), float(record["shared_flops"]) / layout.world)


def cores(layout: Any, record: dict[str, Any]) -> float:
    """The cores the run's ranks got together: their rate all computing at once over one rank's
    alone (:func:`rate`), at most one a rank."""
    return float(record["shared_flops"]) / rate(layout, record)


def scale(p: Any, hw: Any, model: Any, layout: Any, batch: int, seq: int, record: dict[str, Any]) -> float:
    """The rank's measured matmul rate (:func:`rate`) over the table's for its shape (1: the table is right)."""
    return rate(layout, record) / p.matmul_rate(hw, *shape(model, layout, batch, seq))


def beside(p: Any, hw: Any, model: Any, layout: Any, batch: int, seq: int, record: dict[str, Any]) -> Any:
    """``hw`` with its matmul rates (the table's rows, or its peak where it has none) scaled by
    :func:`scale` and its cores the run's (:func:`cores`): the compute rate measured in the run's
    ranks. ``record``: the run's ``cost`` record (only ``alone_flops`` and ``shared_flops`` are read)."""
    factor = scale(p, hw, model, layout, batch, seq, record)
    out = copy.deepcopy(hw)
    out.matmul = [[m, k, n, r * factor] for m, k, n, r in hw.matmul]
    out.peak, out.attention, out.attention_backward = (x * factor for x in (hw.peak, hw.attention,
                                                                             hw.attention_backward))
    out.cores = cores(layout, record)
    return out
