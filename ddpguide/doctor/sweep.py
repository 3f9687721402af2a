"""The all-reduce sweep (bus bandwidth, as nccl-tests reports it) and the per-link pass."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def iterations_for(size: int) -> int:
    """The same count on every rank (they must call the collective equally often)."""
    return max(3, min(50, (32 * 2 ** 20) // size))


#: After this many seconds, rank 0 shows each size on stderr as it is measured (stdout keeps the report).
PROGRESS_AFTER_S = 3.0


def bandwidth_sweep(sizes: tuple[int, ...], device: torch.device, after_first: Any = None,
                    progress_after_s: float = PROGRESS_AFTER_S) -> list[dict[str, Any]]:
    """This rank's time per all-reduce of each size (float32), after one warm-up call.

    ``after_first`` (tests only) is called once the first size is done. Once the sweep has
    run ``progress_after_s``, rank 0 writes a line per size to stderr as it is measured.
    """
    rows: list[dict[str, Any]] = []
    begun = time.monotonic()
    for index, size in enumerate(sizes):
        if index == 1 and after_first is not None:
            after_first()
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
        if dist.get_rank() == 0 and time.monotonic() - begun >= progress_after_s:
            print(f"ddpguide doctor: all_reduce sweep {index + 1}/{len(sizes)}: {size} bytes, "
                  f"{1e3 * rows[-1]['seconds']:.3f} ms (rank 0's time)", file=sys.stderr, flush=True)
    return rows


def bus_factor(world: int) -> float:
    """nccl-tests' all-reduce convention: bus bandwidth = algorithm bandwidth * 2(n-1)/n."""
    return 2 * (world - 1) / world


def summarize_sweep(per_rank: dict[int, list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """Per size: the slowest rank's time defines the collective; algbw = bytes / time.

    A collective ends at about the same time on every rank, so which rank took
    longest says nothing about a slow link: :func:`link_times` measures links.
    """
    rows: list[dict[str, Any]] = []
    if not per_rank:
        return rows
    for index, first in enumerate(next(iter(per_rank.values()))):
        seconds = max(rows_of_rank[index]["seconds"] for rows_of_rank in per_rank.values())
        algbw = first["bytes"] / seconds / 1e9
        rows.append({"bytes": first["bytes"], "seconds": seconds, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * bus_factor(world)})
    return rows


#: The largest message of the per-link pass (the sweep's largest, at most this).
MAX_LINK_BYTES = 64 * 2 ** 20
#: A link (or a host's link) slower than this fraction of the median one is a problem.
SLOW_LINK_FRACTION = 0.5


def link_times(size: int, device: torch.device, iterations: int = 5) -> dict[str, float]:
    """Seconds for ``size`` bytes to arrive at this rank from each ring neighbour.

    All ranks send to their right neighbour and receive from their left at once (every link
    of the ring busy, as in a ring all-reduce), then the other way round. Each of
    ``iterations`` rounds starts at a barrier, and a link's time is the median over the
    rounds of the moment this rank's receive completed: ``from_left`` times the link
    (rank - 1) -> rank, ``from_right`` the link (rank + 1) -> rank. On gloo the receive is
    waited for alone, so a slow outgoing link of this rank does not make its incoming one
    look slow; nccl runs the pair as one group, and its time covers both. Two ranks have one
    neighbour: one pass times both links.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return {}
    left, right = (rank - 1) % world, (rank + 1) % world
    send = torch.ones(max(1, size // 4), device=device)
    received = torch.empty_like(send)
    times = {}
    passes = [("from_left", right, left), ("from_right", left, right)][:1 if world == 2 else 2]
    for name, target, source in passes:
        def once(target: int = target, source: int = source) -> float:
            ops = [dist.P2POp(dist.isend, send, target), dist.P2POp(dist.irecv, received, source)]
            started = time.perf_counter()
            works = dist.batch_isend_irecv(ops)
            works[-1].wait()  # the receive (gloo), or the whole group (nccl: one work)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took = time.perf_counter() - started
            for work in works[:-1]:
                work.wait()
            return took
        once()  # warm-up (connection set-up)
        rounds = []
        for _ in range(iterations):
            dist.barrier()
            rounds.append(once())
        times[name] = statistics.median(rounds)
    return times


def _upper_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def summarize_links(per_rank: dict[int, dict[str, float]], hosts: dict[int, str],
                    size: int) -> dict[str, Any]:
    """Every directed ring link with its bandwidth, the slowest, and what is too slow.

    Two rules, each against the median of its own kind (a link inside a host is not
    compared with one between hosts, which is always slower):

    * ``slow_links``: a link under :data:`SLOW_LINK_FRACTION` of the median link of its
      kind (inside one host, or between hosts);
    * ``slow_hosts``: with 3 or more hosts, a host's link is as fast as its fastest
      transfer to or from another host (every such transfer crosses it; the other end may
      be the slow one), and a host under :data:`SLOW_LINK_FRACTION` of the median host is
      slow. With 2 hosts every transfer between them crosses both hosts' links, and which
      one is slow cannot be told.
    """
    world = len(hosts)
    links: list[dict[str, Any]] = []
    for rank, times in sorted(per_rank.items()):
        for name, source in (("from_left", (rank - 1) % world), ("from_right", (rank + 1) % world)):
            if name in times:
                links.append({"src": source, "dst": rank, "src_host": hosts[source],
                              "dst_host": hosts[rank], "seconds": times[name],
                              "gbps": size / times[name] / 1e9})
    if not links:
        return {}
    slow_links = []
    for between in (False, True):
        kind = [link for link in links if (link["src_host"] != link["dst_host"]) == between]
        if len(kind) >= 2:
            median = _upper_median([link["gbps"] for link in kind])
            slow_links += [{**link, "median_gbps": median, "between_hosts": between}
                           for link in kind if link["gbps"] < SLOW_LINK_FRACTION * median]
    host_gbps: dict[str, float] = {}
    for link in links:
        if link["src_host"] != link["dst_host"]:
            for host in (link["src_host"], link["dst_host"]):
                host_gbps[host] = max(host_gbps.get(host, 0.0), link["gbps"])
    slow_hosts = []
    if len(host_gbps) >= 3:
        median = _upper_median(list(host_gbps.values()))
        slow_hosts = [{"host": host, "gbps": gbps, "median_gbps": median,
                       "rank": min(r for r, h in hosts.items() if h == host)}
                      for host, gbps in sorted(host_gbps.items())
                      if gbps < SLOW_LINK_FRACTION * median]
    return {"bytes": size, "links": links, "slowest": min(links, key=lambda link: link["gbps"]),
            "median_gbps": _upper_median([link["gbps"] for link in links]),
            "slow_links": slow_links, "hosts": host_gbps, "slow_hosts": slow_hosts}
