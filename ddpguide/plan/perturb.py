"""Whether the time check can fail: each term of the cost model made twice what it is, and
the layouts it then moves out of the band.

:func:`step` is ``plan_step.step``'s total with one term doubled: ``compute`` and ``bubble``
(parts of the step the simulation reports: doubling one adds it again), each collective kind
(every call of that kind takes twice its time, through the whole simulation, hidden or not),
and ``overlap`` (what the model hides behind compute, DDP's all-reduce and FSDP's streams,
hidden no more). :func:`check` scores every measured layout against each perturbed model (a row
may carry its own ``model``, ``hardware``, ``batch`` and ``seq``).
"""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

from ddpguide.plan import checks

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
TERMS = ("compute", "bubble", *COLLECTIVES, "overlap")
BAND = (0.8, 1.25)


def step(p: ModuleType, term: str, model: Any, layout: Any, policy: Any, hw: Any, batch: int, seq: int) -> float:
    """The predicted step (seconds) with ``term`` doubled (``""``: as the model has it)."""
    if term in ("", "compute", "bubble"):
        parts = p.step(model, layout, policy, hw, batch, seq)
        return parts["total"] + (parts[term] if term else 0.0)
    if term == "overlap":
        hidden = copy.deepcopy(hw)
        hidden.overlap = hidden.streams = False
        return p.step(model, layout, policy, hidden, batch, seq)["total"]
    if term not in COLLECTIVES:
        raise ValueError(f"no term {term!r}: one of {', '.join(TERMS)}")
    formulas = getattr(p, "formulas", p)  # plan_cost, whose collective both programs call
    original = formulas.collective

    def doubled(hw: Any, lay: Any, kind: str, *args: Any, **kwargs: Any) -> float:
        return original(hw, lay, kind, *args, **kwargs) * (2.0 if kind == term else 1.0)
    vars(formulas)["collective"] = doubled  # called by its global name, or as plan_cost.collective
    try:
        return p.step(model, layout, policy, hw, batch, seq)["total"]
    finally:
        vars(formulas)["collective"] = original


def _case(row: dict[str, Any], model: Any, policy: Any, hw: Any, batch: int, seq: int) -> tuple:
    """A row's (model, layout, policy, hardware, batch, seq): the row's own model, hardware,
    batch and sequence where it has them (a layout predicted with the rate beside its run)."""
    return (row.get("model", model), row["layout"], policy, row.get("hardware", hw), row.get("batch", batch),
            row.get("seq", seq))


def check(p: ModuleType, rows: list[dict[str, Any]], model: Any, policy: Any, hw: Any, batch: int,
          seq: int) -> dict[str, dict[str, Any]]:
    """For each term (and ``""``, the model as it is): the layouts within the band, Spearman's
    rank correlation, and ``out_of_band`` (1: the doubled term moved a layout out of the band
    that the model as it is keeps in it, or Spearman below 0.8; the check caught the error)."""
    measured = [r["measured"] for r in rows]
    out: dict[str, dict[str, Any]] = {}
    for term in ("", *TERMS):
        predicted = [step(p, term, *_case(r, model, policy, hw, batch, seq)) for r in rows]
        inside = [BAND[0] <= a / b <= BAND[1] for a, b in zip(predicted, measured)]
        out[term] = {"within": sum(inside), "layouts": len(rows), "inside": inside,
                     "rank_correlation": checks.spearman(predicted, measured)}
    base = out[""]["inside"]
    for term in TERMS:
        moved = sum(b and not a for a, b in zip(out[term]["inside"], base))
        out[term]["moved_out"] = moved
        out[term]["out_of_band"] = int(moved > 0 or out[term]["rank_correlation"] < 0.8)
    return out


def shares(p: ModuleType, rows: list[dict[str, Any]], model: Any, policy: Any, hw: Any, batch: int,
           seq: int) -> list[float]:
    """Each layout's predicted compute over its predicted step."""
    found = [p.step(*_case(r, model, policy, hw, batch, seq)) for r in rows]
    return [s["compute"] / s["total"] for s in found]
