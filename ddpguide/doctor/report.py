"""Rank 0's report: one line per rank, the checks, one line per problem, one summary line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddpguide.doctor.options import format_size
from ddpguide.doctor.sweep import bus_factor


def new_report(world_size: int, master: str, timeout_s: float, launcher: str) -> dict[str, Any]:
    """An empty report; the worker fills it in as the checks run."""
    return {"ok": False, "world_size": world_size, "master": master, "timeout_s": timeout_s,
            "launcher": launcher, "ranks": [], "problems": [], "collectives": {},
            "bandwidth": [], "links": {}, "seconds": None}


def _rank_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'rank':>4}  {'host':<16} {'local':>5}  {'device':<13} {'pid':>7}  "
             f"{'torch':<14} {'nccl':<8} {'backend':<7} {'connect':>9}"]
    for r in sorted(records, key=lambda r: (r["rank"], r["pid"])):
        lines.append(f"{r['rank']:>4}  {r['host'][:16]:<16} "
                     f"{r['local_rank']:>2}/{r['local_world_size']:<2}  {r['device']:<13} "
                     f"{r['pid']:>7}  {r['versions']['torch']:<14} "
                     f"{r['versions'].get('nccl') or '-':<8} {r['backend']:<7} "
                     f"{r['connect_ms']:>6.1f} ms")
    return lines


def _agreement_line(report: dict[str, Any]) -> str:
    records = report["ranks"]
    hosts = sorted({r["host"] for r in records})
    versions = records[0]["versions"]
    backend = f"nccl {versions['nccl']}" if versions.get("nccl") else "gloo"
    return (f"launcher: {records[0]['launcher']}; WORLD_SIZE={report['world_size']}, "
            f"MASTER_ADDR:MASTER_PORT={report['master']} on every rank; "
            f"{len(hosts)} host(s): {', '.join(hosts)}; torch {versions['torch']}, "
            f"CUDA {versions['cuda'] or '-'}, {backend}")


def _gpu_lines(records: list[dict[str, Any]]) -> list[str]:
    seen = {r["host"]: (r["gpus_visible"], r["gpus_simulated"]) for r in records}
    parts = [f"{host}: {count}{' simulated' if fake else ''}" for host, (count, fake) in sorted(seen.items())]
    lines = ["GPUs visible per host: " + ", ".join(parts)]
    checked = sorted((r for r in records if r.get("gpu_health")), key=lambda r: r["rank"])
    if checked:
        lines.append("each rank's GPU (free memory, other processes by nvidia-smi, a float64 "
                     "matmul against the CPU):")
    for r in checked:
        health = r["gpu_health"]
        others = ("not checked (no nvidia-smi)" if health["processes"] is None
                  else f"{len(health['processes'])} other process(es)")
        lines.append(f"  rank {r['rank']:>3}  {r['gpu_id'][:24]:<24} "
                     f"{health['free_bytes'] / 2**30:.1f} of {health['total_bytes'] / 2**30:.1f} GiB "
                     f"free, {others}, matmul error {health['matmul_error']:.1e}")
    return lines


def _collective_lines(collectives: dict[str, list[dict[str, Any]]]) -> list[str]:
    if not collectives:
        return []
    names: list[str] = []
    for results in collectives.values():
        names += [r["name"] for r in results if r["name"] not in names]
    lines = ["collectives (each rank's result against the known one):"]
    for name in names:
        outcomes = {rank: next((r for r in results if r["name"] == name), None)
                    for rank, results in collectives.items()}
        failed = {rank: r for rank, r in outcomes.items() if r is not None and not r["ok"]}
        found = [r for r in outcomes.values() if r is not None]
        if failed:
            for rank, r in sorted(failed.items(), key=lambda item: int(item[0])):
                lines.append(f"  {name:<24} FAILED on rank {rank}: {r['detail']}")
        elif len(found) == len(outcomes):
            slowest = max(r["ms"] for r in found)
            lines.append(f"  {name:<24} ok    ({slowest:.1f} ms)")
        else:
            lines.append(f"  {name:<24} not run")
    return lines


def _bandwidth_lines(rows: list[dict[str, Any]], world: int) -> list[str]:
    if not rows:
        return []
    lines = [f"all_reduce sweep (float32, {world} ranks; algbw = bytes/time, "
             f"busbw = algbw * 2(n-1)/n = algbw * {bus_factor(world):.2f}):",
             f"  {'size':>8} {'time':>10} {'algbw':>11} {'busbw':>11}"]
    for row in rows:
        lines.append(f"  {format_size(row['bytes']):>8} {1e3 * row['seconds']:>7.3f} ms "
                     f"{row['algbw_gbps']:>6.3f} GB/s {row['busbw_gbps']:>6.3f} GB/s")
    return lines


def _link_lines(links: dict[str, Any]) -> list[str]:
    if not links:
        return []
    lines = [f"ring links (send/recv of {format_size(links['bytes'])} to each neighbour, "
             "both directions, all links at once):"]
    for link in sorted(links["links"], key=lambda link: (link["src"], link["dst"])):
        lines.append(f"  {link['src']:>3} -> {link['dst']:<3} {link['src_host'][:16]:>16} -> "
                     f"{link['dst_host'][:16]:<16} {link['gbps']:>7.3f} GB/s")
    hosts = links.get("hosts") or {}
    if hosts:
        lines.append("hosts' links (each host's fastest transfer to or from another host"
                     + ("):" if len(hosts) >= 3 else
                        "; with 2 hosts both cross both links, so a slow one cannot be placed):"))
        lines += [f"  {host[:16]:<16} {gbps:>7.3f} GB/s" for host, gbps in sorted(hosts.items())]
    return lines


def format_report(report: dict[str, Any]) -> list[str]:
    """The lines rank 0 prints."""
    lines = [f"ddpguide doctor: {report['world_size']} rank(s) expected, rendezvous at "
             f"{report['master']}, timeout {report['timeout_s']:g} s"]
    if report["ranks"]:
        lines += _rank_lines(report["ranks"])
        if not report["problems"]:
            lines += [_agreement_line(report), *_gpu_lines(report["ranks"])]
    lines += _collective_lines(report["collectives"])
    lines += _bandwidth_lines(report["bandwidth"], report["world_size"])
    lines += _link_lines(report.get("links") or {})
    lines += [f"PROBLEM rank {p['rank']} (host {p['host']}): {p['message']}" for p in report["problems"]]
    lines.append(summary_line(report))
    return lines


def summary_line(report: dict[str, Any]) -> str:
    """``summary: OK ...`` or ``summary: N problem(s) ...``."""
    seconds = f" in {report['seconds']:.1f} s" if report["seconds"] is not None else ""
    if report["ok"]:
        hosts = len({r["host"] for r in report["ranks"]})
        slow = ""
        if report["bandwidth"]:
            last = report["bandwidth"][-1]
            slow = f"; busbw at {format_size(last['bytes'])}: {last['busbw_gbps']:.3f} GB/s"
        if report.get("links"):
            link = report["links"]["slowest"]
            slow += (f"; slowest link {link['src']} -> {link['dst']} ({link['src_host']} -> "
                     f"{link['dst_host']}): {link['gbps']:.3f} GB/s")
        return f"summary: OK: {report['world_size']} rank(s) on {hosts} host(s) passed every check{seconds}{slow}"
    count = len(report["problems"])
    return f"summary: {count} problem(s) found{seconds}; exit status 1"


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    """Write the report atomically (a reader never sees half a file)."""
    if path is None:
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    partial.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(partial, path)
