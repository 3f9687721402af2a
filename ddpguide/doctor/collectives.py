"""Every collective the book uses, checked against its known result, and an all-reduce sweep.

Each check builds inputs whose result is known in closed form (small integers
in float32, so sums are exact) and compares what came back. The first check
that fails or raises ends the series: after a collective went wrong, the ranks
may no longer be in step, and the next collective could only time out.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddpguide.core.commands import one_line

Check = Callable[[int, int, torch.device], tuple[torch.Tensor | list[torch.Tensor], Any]]


def _all_reduce_sum(rank: int, world: int, device: torch.device):
    tensor = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor, torch.full((4,), world * (world + 1) / 2)


def _all_reduce_max(rank: int, world: int, device: torch.device):
    tensor = torch.tensor([float(rank), float(-rank)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor, torch.tensor([float(world - 1), 0.0])


def _broadcast(rank: int, world: int, device: torch.device):
    source = world - 1  # not rank 0: a broadcast that ignores src would pass from 0
    tensor = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    dist.broadcast(tensor, src=source)
    return tensor, torch.arange(4, dtype=torch.float32) + 10 * source


def _all_gather(rank: int, world: int, device: torch.device):
    pieces = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(pieces, torch.full((2,), float(rank), device=device))
    return pieces, [torch.full((2,), float(r)) for r in range(world)]


def _reduce_scatter_input(source: int, target: int, world: int) -> torch.Tensor:
    return torch.full((3,), float(source * world + target))


def _reduce_scatter(rank: int, world: int, device: torch.device):
    output = torch.zeros(3, device=device)
    dist.reduce_scatter(output, [_reduce_scatter_input(rank, j, world).to(device) for j in range(world)])
    return output, sum(_reduce_scatter_input(s, rank, world) for s in range(world))


def _all_to_all(rank: int, world: int, device: torch.device):
    outputs = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_to_all(outputs, [torch.tensor([100.0 * rank + j], device=device) for j in range(world)])
    return outputs, [torch.tensor([100.0 * j + rank]) for j in range(world)]


def _send_recv_ring(rank: int, world: int, device: torch.device):
    if world == 1:  # nobody to talk to
        return torch.zeros(1), torch.zeros(1)
    received = torch.zeros(1, device=device)
    # Both posted before waiting: a blocking send first would deadlock on some backends.
    requests = [dist.isend(torch.tensor([float(rank)], device=device), dst=(rank + 1) % world),
                dist.irecv(received, src=(rank - 1) % world)]
    for request in requests:
        request.wait()
    return received, torch.tensor([float((rank - 1) % world)])


def _barrier(rank: int, world: int, device: torch.device):
    dist.barrier()
    return torch.zeros(1), torch.zeros(1)


CHECKS: dict[str, Check] = {
    "all_reduce sum": _all_reduce_sum,
    "all_reduce max": _all_reduce_max,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "send/recv ring": _send_recv_ring,
    "barrier": _barrier,
}


def _same(got, expected) -> bool:
    if isinstance(got, list):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    return torch.equal(got.cpu(), expected)


def _brief(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_brief(v) for v in value) + "]"
    return str(value.cpu().tolist())


def check_collectives(rank: int, world: int, device: torch.device, timeout_s: float,
                      monitor_group: Any = None) -> list[dict[str, Any]]:
    """Run :data:`CHECKS`, then ``monitored_barrier``; one result dict per check run."""
    results = []
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            got, expected = check(rank, world, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = _same(got, expected)
            detail = "" if ok else f"got {_brief(got)}, expected {_brief(expected)}"
        except Exception as error:
            ok, detail = False, f"{type(error).__name__}: {one_line(error, 300)}"
        results.append({"name": name, "ok": ok, "detail": detail,
                        "ms": round(1e3 * (time.perf_counter() - started), 3)})
        if not ok:
            return results
    started = time.perf_counter()
    try:  # gloo only: on nccl the caller passes a gloo group
        dist.monitored_barrier(group=monitor_group, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
        ok, detail = True, ""
    except Exception as error:
        ok, detail = False, f"{type(error).__name__}: {one_line(error, 300)}"
    results.append({"name": "monitored_barrier", "ok": ok, "detail": detail,
                    "ms": round(1e3 * (time.perf_counter() - started), 3)})
    return results


def iterations_for(size: int) -> int:
    """The same count on every rank (they must call the collective equally often)."""
    return max(3, min(50, (32 * 2 ** 20) // size))


def bandwidth_sweep(sizes: tuple[int, ...], device: torch.device) -> list[dict[str, Any]]:
    """This rank's time per all-reduce of each size (float32), after one warm-up call."""
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, device=device)
        dist.all_reduce(tensor)
        iterations = iterations_for(size)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rows.append({"bytes": size, "iterations": iterations,
                     "seconds": (time.perf_counter() - started) / iterations})
    return rows


def bus_factor(world: int) -> float:
    """nccl-tests' all-reduce convention: bus bandwidth = algorithm bandwidth * 2(n-1)/n."""
    return 2 * (world - 1) / world


def summarize_sweep(per_rank: dict[int, list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """Per size: the slowest rank's time defines the collective; algbw = bytes / time."""
    rows = []
    if not per_rank:
        return rows
    for index, first in enumerate(next(iter(per_rank.values()))):
        times = {rank: rows_of_rank[index]["seconds"] for rank, rows_of_rank in per_rank.items()}
        slowest = max(times, key=times.get)
        seconds = times[slowest]
        algbw = first["bytes"] / seconds / 1e9
        rows.append({"bytes": first["bytes"], "seconds": seconds, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * bus_factor(world), "slowest_rank": slowest,
                     "spread": seconds / min(times.values()) - 1})
    return rows
