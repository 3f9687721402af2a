"""The time check's saved run read back, and run again live on chapter 15's cluster.

``python -m ddpguide.bench plan`` saves (``book/measurements/plan.json``) the cluster's
hardware as its microbenchmarks measured it and every layout's measured step. :func:`rows`
predicts each layout again with the program as it is now, from that saved hardware only, and
with DTensor's constants in place of its links; :func:`ranking` scores the predictions;
:func:`live` runs a few layouts on a cluster made now (root) and predicts them from the saved
hardware.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from ddpguide.plan import catalog, checks, hardware, measure, search

BENCH = Path(__file__).resolve().parents[2] / "book" / "measurements" / "plan.json"


def load(path: Path = BENCH) -> dict[str, Any]:
    """The saved benchmark run."""
    return json.loads(Path(path).read_text())


def cluster_hardware(p: ModuleType, bench: dict[str, Any]) -> Any:
    """The cluster's ``Hardware`` as the saved run measured it."""
    found = next(m for m in bench["measurements"] if m["name"] == "cluster hardware")["details"]
    return hardware.from_fields(p, {**found["hardware"], "matmul": found["matmul"]}, f"{BENCH.name}: cluster hardware",
                                known_only=True)


def model(p: ModuleType) -> Any:
    """The GPT of the time check."""
    return catalog.model(p, "gpt", **checks.TIME_MODEL)


def rows(p: ModuleType, bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Every layout of the saved run: measured step, predicted now, DTensor's constants' step."""
    hw, m, pol = cluster_hardware(p, bench), model(p), catalog.policy(p, "float32")
    dt = checks.dtensor_hardware(hw)
    steps = {x["name"][:-len(": step")]: x for x in bench["measurements"] if x["name"].endswith(": step")}
    out = []
    for lay in search.plain(p, m, checks.NODES * checks.RANKS_PER_NODE, checks.TIME_BATCH, checks.TIME_SEQ):
        name = search.name(lay)
        if name not in steps:
            continue
        step = p.step(m, lay, pol, hw, checks.TIME_BATCH, checks.TIME_SEQ)
        out.append({"name": name, "layout": lay, "measured": steps[name]["value"] / 1e3, "predicted": step["total"],
                    "parts": step, "dtensor": p.step(m, lay, pol, dt, checks.TIME_BATCH, checks.TIME_SEQ)["total"],
                    "load": steps[name]["details"].get("load_before")})
    return out


def ranking(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman's rank correlation and the choice, with the measured links and with DTensor's."""
    predicted, measured, dtensor = ([r[k] for r in found] for k in ("predicted", "measured", "dtensor"))
    ratios = [a / b for a, b in zip(predicted, measured)]
    return {"rank_correlation": checks.spearman(predicted, measured),
            "best_layout_measured_over_best_measured": checks.choice(predicted, measured),
            "rank_correlation_dtensor_constants": checks.spearman(dtensor, measured),
            "best_layout_measured_over_best_measured_dtensor_constants": checks.choice(dtensor, measured),
            "within": sum(0.8 <= r <= 1.25 for r in ratios), "layouts": len(ratios),
            "min": min(ratios), "max": max(ratios)}


def live(p: ModuleType, bench: dict[str, Any], names: tuple[str, ...], steps: int = 3) -> list[dict[str, Any]]:
    """Run these layouts now on a cluster of the saved run's shape and link (root needed);
    each beside its prediction from the saved hardware."""
    from ddpguide.cluster import Spec, up

    hw, m, pol = cluster_hardware(p, bench), model(p), catalog.policy(p, "float32")
    layouts = {search.name(lay): lay for lay in search.plain(p, m, checks.NODES * checks.RANKS_PER_NODE,
                                                              checks.TIME_BATCH, checks.TIME_SEQ)}
    out = []
    with up(Spec(nodes=checks.NODES, ranks_per_node=checks.RANKS_PER_NODE, link=checks.LINK)) as cluster:
        for name in names:
            result = measure.run_on_cluster(cluster, layouts[name], m, checks.TIME_SEQ, checks.TIME_BATCH,
                                            "float32", steps=steps)
            predicted = p.step(m, layouts[name], pol, hw, checks.TIME_BATCH, checks.TIME_SEQ)["total"]
            out.append({"name": name, "measured": result["step_seconds"], "predicted": predicted,
                        "memory": measure.memory_ratios(p, layouts[name], m, pol, checks.TIME_SEQ,
                                                        checks.TIME_BATCH, result)["peak"]})
    return out
