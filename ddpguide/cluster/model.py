"""The formulas the cluster chapter checks: alpha-beta fits, bytes on the link, times.

Ranks are numbered node by node (node k holds ranks kL .. kL+L-1), and gloo's ring
visits them in rank order, so each node has exactly one ring edge leaving it. With
p = nodes * L ranks and n = nodes, the payload that leaves each node is:

* ring all-reduce of N bytes: 2(p-1)/p * N (every ring edge carries that much);
* ring all-gather of N bytes (the gathered size): (p-1)/p * N;
* reduce-scatter of N bytes: gloo's runs as its all-reduce, 2(p-1)/p * N (counted alone
  in the collectives program's ``reduce_scatter`` phase); nccl's ring sends (p-1)/p * N
  (not measured here: no GPU);
* hierarchical all-reduce: only the all-reduce across nodes of each rank's N/L slice
  leaves the node, L of them: 2(n-1)/n * N;
* FSDP2 step (1-D mesh over all ranks, parameters of P bytes): an all-gather in
  forward, another in backward, and the reduce-scatter of the gradients:
  2 (p-1)/p * P + 2(p-1)/p * P on gloo (3 P at p = 4), 3 (p-1)/p * P on nccl (2.25 P);
* HSDP step (shard inside the node, replicate across): 2(n-1)/n * P.

Times: a transfer of n bytes takes alpha + n / beta, alpha the latency of one message
(measured by a ping-pong of small messages: a sweep of large ones cannot identify it) and
beta the link's payload rate (the slope of the sweep). On a link shaped by tc's token
bucket the sweep's intercept is not a latency: the bucket lets its first ``burst`` bytes
through at once, so the line of large messages crosses zero near -burst / rate.
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


def reduce_scatter_bytes(n_bytes: float, ranks: int, backend: str = "gloo") -> float:
    """gloo reduce-scatters by an all-reduce (the interfaces count it); nccl's ring sends
    each rank's N/p slice on p-1 hops."""
    if backend == "gloo":
        return ring_all_reduce_bytes(n_bytes, ranks)
    if backend == "nccl":
        return ring_all_gather_bytes(n_bytes, ranks)
    raise ValueError(f"no reduce-scatter formula for backend {backend!r} (gloo or nccl)")


def fsdp_step_bytes(param_bytes: float, ranks: int, backend: str = "gloo") -> float:
    """Two all-gathers and one reduce-scatter of P bytes."""
    return (2 * ring_all_gather_bytes(param_bytes, ranks)
            + reduce_scatter_bytes(param_bytes, ranks, backend))


def hsdp_step_bytes(param_bytes: float, nodes: int) -> float:
    """Only the all-reduce of the gradient shards across the nodes leaves a node."""
    return hierarchical_bytes(param_bytes, nodes)


def flat_time(n_bytes: float, ranks: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(p-1) steps, each moving N/p over the link (one edge per node)."""
    return 2 * (ranks - 1) * (alpha + n_bytes / ranks / beta)


def hierarchical_time(n_bytes: float, nodes: int, local: int, alpha: float, beta: float,
                      alpha_in: float, beta_in: float, backend: str = "gloo") -> float:
    """Reduce-scatter and all-gather inside the node, and an all-reduce across the nodes
    (2(n-1) steps; the L slices share the link, N/n a step). Inside the node the all-gather
    takes L-1 steps of N/L, and the reduce-scatter as many on nccl but 2(L-1) on gloo, whose
    reduce-scatter is an all-reduce."""
    steps_in = {"gloo": 3, "nccl": 2}.get(backend)
    if steps_in is None:
        raise ValueError(f"no reduce-scatter formula for backend {backend!r} (gloo or nccl)")
    inside = steps_in * (local - 1) * (alpha_in + n_bytes / local / beta_in)
    across = 2 * (nodes - 1) * (alpha + n_bytes / nodes / beta)
    return inside + across


def burst_intercept(burst: float, beta: float) -> float:
    """Where the alpha-beta line of large messages crosses zero on a token-bucket link: the
    first ``burst`` bytes pass at once, so n bytes take (n - burst) / beta."""
    return -burst / beta


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
