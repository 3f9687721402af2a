"""A layout's compute rate measured beside its own run, for that layout's prediction.

The matmul table (``plan_measure.py --measure``) is timed minutes before the runs it serves.
On a loaded machine the same matmul's rate moves 2-4x within a minute, so a table timed then
can be far from the rate a run gets now: the whole compute term is off by that factor.

``train.py --cost`` times a matmul of its MLP's shape (``cost_meter.matmul_peak``: ``rows x
dim`` by ``dim x ffn``, the best of five timings of ten) in every rank's process, all ranks
at once, after the model is built and before its first step: a separate timing in the same
process, not a step. Its ``peak_flops`` (the slowest rank's) is the rate this module uses.
It is the best of five short windows, so it can read the rate of a rank that has a core to
itself for that window even where ranks share the cores: it is taken as the table's rates are
(one process alone), not as a shared rate. :func:`beside` scales
every rate of the table by the run's rate over the table's rate for the same shape, and the
simulation shares the cores among the busy ranks as before (``Hardware.cores``, still the
table's). The result is the hardware for that one layout's prediction. The step time of the
run is never read: nothing here is fitted to the number being predicted.
"""

from __future__ import annotations

import copy
from typing import Any


def shape(model: Any, layout: Any, batch: int, seq: int) -> tuple[int, int, int]:
    """The (m, k, n) of the matmul ``train.py --cost`` times: a rank's rows (its share of the
    batch of one accumulation step, its chunk of the sequence) by the width, and the width by
    the MLP's."""
    return batch // layout.accumulate // layout.data_parallel * seq // layout.cp, model.dim, model.ffn


def scale(p: Any, hw: Any, model: Any, layout: Any, batch: int, seq: int, record: dict[str, Any]) -> float:
    """The run's measured matmul rate over the table's prediction of it (1: the table is right)."""
    return float(record["peak_flops"]) / p.matmul_rate(hw, *shape(model, layout, batch, seq))


def beside(p: Any, hw: Any, model: Any, layout: Any, batch: int, seq: int, record: dict[str, Any]) -> Any:
    """``hw`` with its matmul rates (the table's rows, or its peak where it has none) scaled by
    :func:`scale`: the compute rate measured beside this run. ``record``: the run's ``cost``
    record (only its ``peak_flops`` is read)."""
    factor = scale(p, hw, model, layout, batch, seq, record)
    out = copy.deepcopy(hw)
    out.matmul = [[m, k, n, rate * factor] for m, k, n, rate in hw.matmul]
    out.peak, out.attention, out.attention_backward = (x * factor for x in (hw.peak, hw.attention,
                                                                             hw.attention_backward))
    return out
