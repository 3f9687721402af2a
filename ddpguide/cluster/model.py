"""The formulas the cluster chapter checks: alpha-beta fits, bytes on the link, times.

Ranks are numbered node by node (node k holds ranks kL .. kL+L-1), and gloo's ring
visits them in rank order, so each node has exactly one ring edge leaving it. With
p = nodes * L ranks and n = nodes, the payload that leaves each node is:

* ring all-reduce of N bytes: 2(p-1)/p * N (every ring edge carries that much);
* ring all-gather of N bytes (the gathered size): (p-1)/p * N;
* gloo's reduce-scatter of N bytes: as its all-reduce, 2(p-1)/p * N (counted alone
  in the collectives program's ``reduce_scatter`` phase);
* hierarchical all-reduce: only the all-reduce across nodes of each rank's N/L slice
  leaves the node, L of them: 2(n-1)/n * N;
* FSDP2 step (1-D mesh over all ranks, parameters of P bytes): an all-gather in
  forward, another in backward, and gloo's reduce-scatter of the gradients:
  2 (p-1)/p * P + 2(p-1)/p * P;
* HSDP step (shard inside the node, replicate across): 2(n-1)/n * P.
"""

from __future__ import annotations

import statistics


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = alpha + bytes / beta``: (alpha in s, beta in bytes/s)."""
    xs, ys = [float(b) for b, _ in points], [float(t) for _, t in points]
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("an alpha-beta fit needs at least two sizes")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return my - slope * mx, 1.0 / slope


def ring_all_reduce_bytes(n_bytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * n_bytes


def ring_all_gather_bytes(n_bytes: float, ranks: int) -> float:
    return (ranks - 1) / ranks * n_bytes


def hierarchical_bytes(n_bytes: float, nodes: int) -> float:
    return 2 * (nodes - 1) / nodes * n_bytes


def fsdp_step_bytes(param_bytes: float, ranks: int) -> float:
    """Two all-gathers and gloo's reduce-scatter (sent as an all-reduce) of P bytes."""
    return 2 * ring_all_gather_bytes(param_bytes, ranks) + ring_all_reduce_bytes(param_bytes, ranks)


def hsdp_step_bytes(param_bytes: float, nodes: int) -> float:
    """Only the all-reduce of the gradient shards across the nodes leaves a node."""
    return hierarchical_bytes(param_bytes, nodes)


def flat_time(n_bytes: float, ranks: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(p-1) steps, each moving N/p over the link (one edge per node)."""
    return 2 * (ranks - 1) * (alpha + n_bytes / ranks / beta)


def hierarchical_time(n_bytes: float, nodes: int, local: int, alpha: float, beta: float,
                      alpha_in: float, beta_in: float) -> float:
    """Reduce-scatter and all-gather inside the node (L-1 steps of N/L each), and an
    all-reduce across the nodes (2(n-1) steps; the L slices share the link, N/n a step)."""
    inside = 2 * (local - 1) * (alpha_in + n_bytes / local / beta_in)
    across = 2 * (nodes - 1) * (alpha + n_bytes / nodes / beta)
    return inside + across


def exposed_prediction(run: dict) -> dict[str, float]:
    """DDP's exposed communication, predicted from the parts timed alone.

    Buckets become ready as backward reaches them (backward time shared out by bytes,
    the layers being alike) and go over the link one after another, each taking its
    share by bytes of ``comm_seconds``, the time of the same buckets all-reduced alone.
    Exposed is what ends after backward. ``simple`` is max(0, T_comm - T_backward), the
    limit of many small buckets.
    """
    forward, compute, comm = run["forward_seconds"], run["compute_seconds"], run["comm_seconds"]
    backward = max(0.0, compute - forward)
    total = float(sum(run["buckets"]))
    end, done = 0.0, 0.0
    for size in run["buckets"]:
        done += size
        end = max(end, forward + backward * done / total) + comm * size / total
    return {"bucketed": max(0.0, end - compute), "simple": max(0.0, comm - backward),
            "comm": comm}
