"""Rank 0's verdict on the records of every rank that arrived: do the launchers agree?

Pure functions over the per-rank records of :func:`ddpguide.doctor.facts.rank_facts`,
so every rule can be tested without starting a process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from ddpguide.doctor.gpu import MATMUL_SIZE


@dataclass(frozen=True)
class Problem:
    """One thing that will break or slow the job, pinned to a rank and a host."""

    rank: int | str
    host: str
    message: str

    def line(self) -> str:
        """The report's line for it: ``PROBLEM rank R (host H): message``."""
        return f"PROBLEM rank {self.rank} (host {self.host}): {self.message}"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return asdict(self)


def _ranks(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in sorted(values))


def missing_ranks(world_size: int, arrived: Sequence[int], timeout_s: float,
                  master: str) -> list[Problem]:
    """One problem per rank below WORLD_SIZE that never registered."""
    absent = sorted(set(range(world_size)) - set(arrived))
    return [Problem(rank, "unknown", f"did not arrive at {master} within {timeout_s:g} s "
                    f"(WORLD_SIZE={world_size}; arrived: ranks {_ranks(arrived) or 'none'})")
            for rank in absent]


def launcher_problems(records: Sequence[dict[str, Any]], reference: dict[str, Any]) -> list[Problem]:
    """Duplicate RANKs, and WORLD_SIZE / MASTER_ADDR / MASTER_PORT that differ from ``reference``."""
    problems = []
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_rank[record["rank"]].append(record)
    for rank, same in sorted(by_rank.items()):
        if len(same) > 1:
            where = ", ".join(f"pid {r['pid']} on {r['host']}" for r in same)
            problems.append(Problem(rank, same[-1]["host"],
                                    f"RANK={rank} is used by {len(same)} processes ({where})"))
    for record in records:
        for key, name in (("world_size", "WORLD_SIZE"), ("master_addr", "MASTER_ADDR"),
                          ("master_port", "MASTER_PORT")):
            if record[key] != reference[key]:
                problems.append(Problem(record["rank"], record["host"],
                                        f"{name}={record[key]}, but rank {reference['rank']} "
                                        f"has {name}={reference[key]}"))
    return problems


def node_problems(records: Sequence[dict[str, Any]], complete: bool = True) -> list[Problem]:
    """Per node (host and GROUP_RANK): LOCAL_RANK in range and unique, LOCAL_WORLD_SIZE right.

    ``complete``: every rank arrived, so a node with fewer ranks than its
    LOCAL_WORLD_SIZE is wrong rather than waiting for a missing rank.
    """
    problems = []
    nodes: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for record in records:
        nodes[(record["host"], record["group_rank"])].append(record)
        if record["local_rank"] >= record["local_world_size"]:
            problems.append(Problem(record["rank"], record["host"],
                                    f"LOCAL_RANK={record['local_rank']} is not smaller than "
                                    f"LOCAL_WORLD_SIZE={record['local_world_size']}"))
    for (host, group_rank), members in sorted(nodes.items()):
        local: dict[int, list[int]] = defaultdict(list)
        for record in members:
            local[record["local_rank"]].append(record["rank"])
        for local_rank, ranks in sorted(local.items()):
            if len(ranks) > 1:
                problems.append(Problem(ranks[-1], host, f"LOCAL_RANK={local_rank} is shared by "
                                        f"ranks {_ranks(ranks)} on node {group_rank}"))
        # Only what a launcher set is held against it (unset, it defaults to WORLD_SIZE).
        sizes = {r["local_world_size"] for r in members if "LOCAL_WORLD_SIZE" in r["variables"]}
        count_wrong = len(sizes) == 1 and (len(members) > min(sizes) or
                                           (complete and len(members) < min(sizes)))
        if len(sizes) > 1 or count_wrong:
            problems.append(Problem(members[0]["rank"], host,
                                    f"node {group_rank} runs {len(members)} ranks "
                                    f"({_ranks(r['rank'] for r in members)}) but LOCAL_WORLD_SIZE "
                                    f"says {' or '.join(str(s) for s in sorted(sizes))}"))
    return problems


def gpu_problems(records: Sequence[dict[str, Any]]) -> list[Problem]:
    """Two ranks on one host that would use the same GPU."""
    problems = []
    users: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        if record["gpu_id"] is not None:
            users[(record["host"], record["gpu_id"])].append(record)
    for (host, gpu_id), sharing in sorted(users.items()):
        first = sharing[0]
        for record in sharing[1:]:
            problems.append(Problem(
                record["rank"], host,
                f"LOCAL_RANK={record['local_rank']} would use GPU {gpu_id}, as rank "
                f"{first['rank']} (LOCAL_RANK={first['local_rank']}) does: two ranks on one GPU "
                f"({record['gpus_visible']} GPU(s) visible, LOCAL_WORLD_SIZE="
                f"{record['local_world_size']})"))
    return problems


def cpu_with_gpu_problems(records: Sequence[dict[str, Any]]) -> list[Problem]:
    """Ranks that see GPUs but would run on the CPU (ranks that would have to share a GPU)."""
    return [Problem(r["rank"], r["host"],
                    f"GPUs visible but this job would run on CPU: {r['gpus_visible']} GPU(s) for "
                    f"LOCAL_WORLD_SIZE={r['local_world_size']} ranks, and nccl needs one GPU per "
                    "rank (run one rank per GPU, or give each rank its own through "
                    "CUDA_VISIBLE_DEVICES)")
            for r in records
            if r["gpus_visible"] and r["gpu_id"] is None and not r.get("cpu_forced")]


#: A GPU with less than this fraction of its memory free before the job starts is a problem
#: (a CUDA context of its own takes a few hundred MiB).
MIN_FREE_FRACTION = 0.9
#: The float64 matmul's largest relative error against the CPU that a sound GPU stays under.
MATMUL_TOLERANCE = 1e-9


def gpu_health_problems(records: Sequence[dict[str, Any]]) -> list[Problem]:
    """Per rank on a GPU (``doctor.gpu``): too little free memory, a process on the GPU that is
    not a rank of this job on that host, a matmul that disagrees with the CPU's."""
    problems = []
    for record in records:
        health, gpu = record.get("gpu_health"), record.get("gpu_id")
        if not health:
            continue
        free, total = health["free_bytes"], health["total_bytes"]
        if total and free < MIN_FREE_FRACTION * total:
            problems.append(Problem(record["rank"], record["host"],
                                    f"GPU {gpu} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} "
                                    f"GiB ({100 * free / total:.0f}%) before the job starts: another "
                                    "process holds the rest"))
        ranks_here = {r["pid"] for r in records if r["host"] == record["host"]}
        for other in health.get("processes") or []:
            if other["pid"] not in ranks_here:
                used = f", {other['used_mib']} MiB" if other["used_mib"] is not None else ""
                problems.append(Problem(record["rank"], record["host"],
                                        f"GPU {gpu} is also used by pid {other['pid']} "
                                        f"({other['name']}{used}), not a rank of this job"))
        if not health["matmul_error"] <= MATMUL_TOLERANCE:  # also catches nan
            problems.append(Problem(record["rank"], record["host"],
                                    f"GPU {gpu} computed a {MATMUL_SIZE} x {MATMUL_SIZE} float64 matmul with a "
                                    f"relative error of {health['matmul_error']:.1e} against the "
                                    f"CPU (at most {MATMUL_TOLERANCE:.0e}): a faulty GPU, driver "
                                    "or clock"))
    return problems


def version_problems(records: Sequence[dict[str, Any]], reference: dict[str, Any]) -> list[Problem]:
    """torch, the nccl version (on nccl) and the backend choice must be the same on every rank."""
    problems = []
    for record in records:
        mine, theirs = record["versions"]["torch"], reference["versions"]["torch"]
        if mine != theirs:
            problems.append(Problem(record["rank"], record["host"],
                                    f"torch {mine}, but rank {reference['rank']} runs torch {theirs}"))
        mine, theirs = record["versions"].get("nccl"), reference["versions"].get("nccl")
        if mine != theirs and "nccl" in (record["backend"], reference["backend"]):
            # A different container image on one node: a classic cause of cross-node hangs.
            problems.append(Problem(record["rank"], record["host"],
                                    f"nccl {mine}, but rank {reference['rank']} has nccl {theirs}"))
        if record["backend"] != reference["backend"]:
            problems.append(Problem(record["rank"], record["host"],
                                    f"backend {record['backend']}, but rank {reference['rank']} "
                                    f"chose {reference['backend']}"))
    return problems


#: variables that name a host's own devices (chapter 15's nodes each have their own interface)
PER_HOST = frozenset({"NCCL_SOCKET_IFNAME"})


def nccl_variable_problems(records: Sequence[dict[str, Any]], reference: dict[str, Any]) -> list[Problem]:
    """On nccl, every ``NCCL_*`` and ``TORCH_NCCL_*`` variable set the same on every rank as on
    ``reference`` (those in :data:`PER_HOST` only on the reference's host)."""
    problems = []
    theirs = reference.get("nccl_variables", {})
    for record in records:
        if "nccl" not in (record["backend"], reference["backend"]):
            continue  # gloo never reads them
        mine = record.get("nccl_variables", {})
        for name in sorted(set(mine) | set(theirs)):
            if name in PER_HOST and record["host"] != reference["host"]:
                continue  # an interface of that host: its name may differ from host to host
            if mine.get(name) != theirs.get(name):
                shown = {k: "unset" if v is None else repr(v) for k, v in
                         (("mine", mine.get(name)), ("theirs", theirs.get(name)))}
                problems.append(Problem(record["rank"], record["host"],
                                        f"{name} {shown['mine']}, but {shown['theirs']} on rank "
                                        f"{reference['rank']}"))
    return problems


def slow_link_problems(links: dict[str, Any], backend: str) -> list[Problem]:
    """What the per-link pass found too slow (the rules are :func:`summarize_links`').

    A slow host's link is a problem on every backend. A single slow link is one on nccl
    only: on gloo, links inside one host are loopback sharing the CPU, and the spread of
    links between hosts is the hosts' load as much as their cables; a host's fastest
    transfer, taken over all its links, is what stands out. On nccl, a link between hosts
    that touches a slow host is not named again.
    """
    if not links:
        return []
    problems = [Problem(slow["rank"], slow["host"],
                        f"slow link: host {slow['host']} moves at most {slow['gbps']:.3f} GB/s to or "
                        f"from any other host (its fastest transfer), under half the median host's "
                        f"{slow['median_gbps']:.3f} GB/s")
                for slow in links.get("slow_hosts", [])]
    if backend != "nccl":
        return problems
    named = {slow["host"] for slow in links.get("slow_hosts", [])}
    for slow in links.get("slow_links", []):
        if slow["between_hosts"] and {slow["src_host"], slow["dst_host"]} & named:
            continue
        kind = "link between hosts" if slow["between_hosts"] else "link inside a host"
        problems.append(Problem(slow["dst"], slow["dst_host"],
                                f"slow link: rank {slow['src']} ({slow['src_host']}) -> rank "
                                f"{slow['dst']} ({slow['dst_host']}) moves {slow['gbps']:.2f} GB/s, "
                                f"under half the {slow['median_gbps']:.2f} GB/s of the median {kind}"))
    return problems


def verdict(records: Sequence[dict[str, Any]], world_size: int, timeout_s: float,
            master: str, strays: Sequence[str] = ()) -> list[Problem]:
    """Every problem rank 0 can see before the process group exists.

    ``records`` holds one record per process that registered (rank 0's first),
    ``strays`` the lines of processes that could not take part (e.g. RANK >= WORLD_SIZE).
    """
    reference = records[0]
    missing = missing_ranks(world_size, [r["rank"] for r in records], timeout_s, master)
    problems = list(missing)
    for line in strays:
        rank, _, rest = line.partition("|")
        host, _, message = rest.partition("|")
        problems.append(Problem(rank, host, message))
    problems += launcher_problems(records, reference)
    problems += node_problems(records, complete=not missing)
    problems += gpu_problems(records)
    problems += cpu_with_gpu_problems(records)
    problems += gpu_health_problems(records)
    problems += version_problems(records, reference)
    problems += nccl_variable_problems(records, reference)
    return problems
