"""Every collective the book uses, checked against its known result, and an all-reduce sweep.

Each check builds inputs whose result is known in closed form (small integers
in float32, so sums are exact) and compares what came back. The first check
that fails or raises ends the series: after a collective went wrong, the ranks
may no longer be in step, and the next collective could only time out.
"""

from __future__ import annotations

import datetime
import functools
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
        assert request is not None  # None only for a rank outside the group
        request.wait()
    return received, torch.tensor([float((rank - 1) % world)])


def _reduce(rank: int, world: int, device: torch.device):
    target = world - 1  # not rank 0, as for broadcast
    tensor = torch.full((3,), float(rank + 1), device=device)
    dist.reduce(tensor, dst=target)
    if rank != target:  # what the others hold afterwards is unspecified
        return torch.zeros(1), torch.zeros(1)
    return tensor, torch.full((3,), world * (world + 1) / 2)


def _gather(rank: int, world: int, device: torch.device):
    target = world - 1
    pieces = [torch.zeros(2, device=device) for _ in range(world)] if rank == target else None
    dist.gather(torch.full((2,), float(rank), device=device), pieces, dst=target)
    if rank != target:
        return torch.zeros(1), torch.zeros(1)
    return pieces, [torch.full((2,), float(r)) for r in range(world)]


def _scatter(rank: int, world: int, device: torch.device):
    source = world - 1
    output = torch.zeros(2, device=device)
    pieces = [torch.full((2,), 10.0 * r + 1, device=device) for r in range(world)] if rank == source else None
    dist.scatter(output, pieces, src=source)
    return output, torch.full((2,), 10.0 * rank + 1)


def _all_gather_single(rank: int, world: int, device: torch.device):
    # all_gather_into_tensor's name since torch 2.14 (FSDP2 and ZeRO-3 gather with it)
    output = torch.zeros(world * 2, device=device)
    dist.all_gather_single(output, torch.full((2,), float(rank), device=device))
    return output, torch.arange(world, dtype=torch.float32).repeat_interleave(2)


def _reduce_scatter_single(rank: int, world: int, device: torch.device):
    # reduce_scatter_tensor's name since torch 2.14
    output = torch.zeros(3, device=device)
    full = torch.cat([_reduce_scatter_input(rank, j, world) for j in range(world)]).to(device)
    dist.reduce_scatter_single(output, full)
    return output, sum(_reduce_scatter_input(s, rank, world) for s in range(world))


def _all_to_all_single_uneven(rank: int, world: int, device: torch.device):
    # Rank r sends j + 1 elements to rank j (uneven splits, as MoE token dispatch does).
    sizes_out = [j + 1 for j in range(world)]
    sizes_in = [rank + 1] * world
    data = torch.cat([torch.full((j + 1,), 100.0 * rank + j) for j in range(world)]).to(device)
    output = torch.zeros(sum(sizes_in), device=device)
    dist.all_to_all_single(output, data, output_split_sizes=sizes_in, input_split_sizes=sizes_out)
    return output, torch.cat([torch.full((rank + 1,), 100.0 * s + rank) for s in range(world)])


def _batch_isend_irecv(rank: int, world: int, device: torch.device):
    if world == 1:
        return torch.zeros(1), torch.zeros(1)
    left, right = (rank - 1) % world, (rank + 1) % world
    from_left, from_right = torch.zeros(1, device=device), torch.zeros(1, device=device)
    mine = torch.tensor([float(rank)], device=device)
    ops = [dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, from_left, left),
           dist.P2POp(dist.isend, mine, left), dist.P2POp(dist.irecv, from_right, right)]
    for request in dist.batch_isend_irecv(ops):  # the pipeline library's way (chapter 5)
        request.wait()
    return [from_left, from_right], [torch.tensor([float(left)]), torch.tensor([float(right)])]


def _objects(rank: int, world: int, device: torch.device):
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})  # DCP's planner exchanges objects
    box: list[Any] = [{"from": world - 1}] if rank == world - 1 else [None]
    dist.broadcast_object_list(box, src=world - 1)
    at_last: list[Any] | None = [None] * world if rank == world - 1 else None
    dist.gather_object(rank * 10, at_last, dst=world - 1)
    got = [float(g["rank"]) for g in gathered] + [float(box[0]["from"])]
    expected = [float(r) for r in range(world)] + [float(world - 1)]
    if at_last is not None:
        got, expected = got + [float(v) for v in at_last], expected + [10.0 * r for r in range(world)]
    return torch.tensor(got), torch.tensor(expected)


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
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "all_gather_single": _all_gather_single,
    "reduce_scatter_single": _reduce_scatter_single,
    "all_to_all_single uneven": _all_to_all_single_uneven,
    "batch_isend_irecv": _batch_isend_irecv,
    "object collectives": _objects,
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


def _sub_groups(rank: int, world: int, device: torch.device, timeout_s: float):
    """All-reduce in the rows and in the columns of a 2 x (world/2) layout of the ranks.

    The groups a 2-D DeviceMesh makes (FSDP x TP, chapter 9), each with the
    doctor's timeout: a sub-group made without one waits c10d's default.
    """
    half = world // 2
    rows = [list(range(0, half)), list(range(half, world))]
    columns = [[c, c + half] for c in range(half)]
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {tuple(ranks): dist.new_group(ranks, timeout=timeout) for ranks in rows + columns}
    results, expected = [], []
    for layout in (rows, columns):
        members = next(ranks for ranks in layout if rank in ranks)
        tensor = torch.full((2,), float(rank + 1), device=device)
        group = groups[tuple(members)]
        assert isinstance(group, dist.ProcessGroup)  # this rank is one of the members
        dist.all_reduce(tensor, group=group)
        results.append(tensor)
        expected.append(torch.full((2,), float(sum(m + 1 for m in members))))
    for group in groups.values():
        dist.destroy_process_group(group)
    return results, expected


def _run(name: str, check: Callable[[], tuple[Any, Any]], device: torch.device) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        got, expected = check()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ok = _same(got, expected)
        detail = "" if ok else f"got {_brief(got)}, expected {_brief(expected)}"
    except Exception as error:
        ok, detail = False, f"{type(error).__name__}: {one_line(error, 300)}"
    return {"name": name, "ok": ok, "detail": detail,
            "ms": round(1e3 * (time.perf_counter() - started), 3)}


def check_collectives(rank: int, world: int, device: torch.device, timeout_s: float,
                      monitor_group: Any = None) -> list[dict[str, Any]]:
    """Run :data:`CHECKS`, the 2-D sub-groups (an even world of 4 or more), then
    ``monitored_barrier``; one result dict per check run, up to the first failure."""
    results = []
    checks: list[tuple[str, Callable[[], tuple[Any, Any]]]] = [
        (name, functools.partial(check, rank, world, device)) for name, check in CHECKS.items()]
    if world >= 4 and world % 2 == 0:
        checks.append((f"sub-groups 2x{world // 2}",
                       lambda: _sub_groups(rank, world, device, timeout_s)))
    for name, check in checks:
        results.append(_run(name, check, device))
        if not results[-1]["ok"]:
            return results

    def monitored():  # gloo only: on nccl the caller passes a gloo group
        dist.monitored_barrier(group=monitor_group, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
        return torch.zeros(1), torch.zeros(1)
    results.append(_run("monitored_barrier", monitored, torch.device("cpu")))
    return results
