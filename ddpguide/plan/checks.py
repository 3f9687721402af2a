"""The planner's checks: rank correlation, the choice, DTensor's built-in constants, and the
GPT the time check runs on chapter 15's cluster.

:func:`spearman` is Spearman's rank correlation (ties ranked by their mean); :func:`choice`
is the measured step of the planner's best layout over the best measured step;
:func:`dtensor_hardware` is this machine's hardware with its links replaced by the
constants DTensor's sharding solver uses (``MeshTopoInfo.build_from_mesh`` and
``allgather_cost`` in ``torch/distributed/tensor/_collective_utils.py``, read from the
installed source).
"""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

#: the time check on chapter 15's emulated cluster: the GPT, its sequence and batch, the link
#: between the nodes and the cluster's shape (4 ranks on this machine's 2 cores)
TIME_MODEL = dict(layers=2, dim=256, heads=4, ffn=1024)
TIME_SEQ, TIME_BATCH, LINK, NODES, RANKS_PER_NODE = 64, 8, "20mbit", 2, 2
#: the memory checks' GPT (``gpt-check``, float64): its sequence and batch, and the prefix of the
#: ratios of torch's trackers against the predicted peak
CHECK_SEQ, CHECK_BATCH, TRACKER = 16, 8, "memory_predicted_over_tracker: "


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (at least 2 values)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman: two lists of the same length, at least 2 values")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def choice(predicted: list[float], measured: list[float]) -> float:
    """Measured step of the layout predicted fastest over the fastest measured step."""
    best = min(range(len(predicted)), key=lambda i: predicted[i])
    return measured[best] / min(measured)


def dtensor_constants() -> dict[str, float]:
    """DTensor's cost constants, read from the installed torch: intra-host bandwidth (GB/s),
    latency a hop (us), the inter-host bandwidth factor and latency, the base latency (us)."""
    from torch.distributed.tensor import _collective_utils as cu

    build = inspect.getsource(cu.MeshTopoInfo.build_from_mesh)
    gather = inspect.getsource(cu.allgather_cost)

    def number(pattern: str, text: str) -> float:
        found = re.search(pattern, text)
        if not found:
            raise LookupError(f"DTensor's cost constants: {pattern!r} not in the installed source")
        return float(found.group(1))
    return {"bandwidth_gb_s": number(r"base_bw = ([\d.]+)", build),
            "latency_us": number(r"mesh_dim_latency = \[([\d.]+)\]", build),
            "inter_factor": number(r"mesh_dim_bandwidth\[mesh_dim\] \*= ([\d.]+)", build),
            "inter_latency_us": number(r"mesh_dim_latency\[mesh_dim\] = ([\d.]+)", build),
            "base_latency_us": number(r"latency = ([\d.]+) \+", gather)}


def dtensor_hardware(hw: Any) -> Any:
    """``hw`` with DTensor's link constants (its bytes/s are GB/s of bus bandwidth)."""
    c = dtensor_constants()
    out = copy.deepcopy(hw)
    out.links = {"node": [c["latency_us"] * 1e-6, 1 / (c["bandwidth_gb_s"] * 1e9)],
                 "net": [c["inter_latency_us"] * 1e-6, 1 / (c["inter_factor"] * c["bandwidth_gb_s"] * 1e9)]}
    out.collective_seconds = c["base_latency_us"] * 1e-6
    return out
