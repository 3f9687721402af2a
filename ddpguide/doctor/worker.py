"""One rank's pre-flight, in phases, each bounded in time.

1. Read the launcher's variables; a rank that cannot take part (``RANK >=
   WORLD_SIZE``) says why, leaves word in the store if it can, and exits.
2. Reach ``MASTER_ADDR:MASTER_PORT`` (rank 0 first starts the store there,
   unless torchrun's agent hosts it) and register this rank's record.
3. Rank 0 waits for ``WORLD_SIZE`` ranks, judges their records and posts the
   verdict; the others wait for it. A problem here ends the run before any
   process group exists.
4. Every rank joins the process group, checks the collectives and times the
   sweep, and posts its results; rank 0 prints the report and posts the end.

A watchdog thread ends the rank with a PROBLEM line at the stated bound.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import uuid
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ddpguide.core.commands import one_line
from ddpguide.core.runtime import Runtime, limit_threads, select_runtime
from ddpguide.doctor.collectives import check_collectives
from ddpguide.doctor.consistency import Problem, slow_link_problems, verdict
from ddpguide.doctor.facts import (
    Identity,
    IdentityError,
    gpu_inventory,
    launcher_name,
    rank_facts,
    read_identity,
)
from ddpguide.doctor.options import Options, watchdog_limit_s
from ddpguide.doctor.rendezvous import (
    Board,
    Heartbeat,
    RendezvousError,
    RootWatch,
    check_resolves,
    host_store,
    join_store,
    key_prefix,
    wait_for_endpoint,
    wait_for_result,
)
from ddpguide.doctor.report import format_report, new_report, write_json
from ddpguide.doctor.storage import (
    clock_problems,
    probe_directory,
    remove_probe,
    shm_problems,
    storage_problems,
)
from ddpguide.doctor.sweep import (
    MAX_LINK_BYTES,
    bandwidth_sweep,
    link_times,
    summarize_links,
    summarize_sweep,
)
from ddpguide.doctor.watch import STOP_AFTER_GROUP, fault, root_silent, start_watchdog


def _leave_word(environ: Mapping[str, str], rank: str, host: str, message: str,
                timeout_s: float) -> None:
    """Best effort: tell rank 0 about a process that cannot take part."""
    try:
        addr, port = environ["MASTER_ADDR"].strip(), int(environ["MASTER_PORT"])
        identity = Identity(-1, 1, 0, 1, 0, addr, port, False)
        wait_for_endpoint(addr, port, time.monotonic() + min(timeout_s, 3.0), min(timeout_s, 3.0))
        Board(join_store(identity, min(timeout_s, 3.0)), key_prefix(environ)).add_stray(rank, host, message)
    except Exception:  # no store to tell: rank 0 will report the rank as missing
        pass


def _group_checks(identity: Identity, runtime: Runtime, board: Board,
                  options: Options, ruling: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint directory, then join the process group over the same store, run the
    checks, leave the group."""
    storage = None
    if options.checkpoint_dir is not None:
        storage = probe_directory(options.checkpoint_dir, ruling["token"], identity.rank,
                                  identity.world_size, min(options.timeout_s, 10.0))
    try:
        result = _collectives(identity, runtime, board, options)
    finally:  # after the collectives: every rank has looked for the others' files by then
        if options.checkpoint_dir is not None:
            remove_probe(options.checkpoint_dir, ruling["token"], identity.rank)
    result["storage"] = storage
    result["clock_skew_s"] = ruling.get("skew_s", 0.0)
    return result


def _collectives(identity: Identity, runtime: Runtime, board: Board,
                 options: Options) -> dict[str, Any]:
    device = runtime.device(identity.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        limit_threads(identity.local_world_size)
    result: dict[str, Any] = {"collectives": [], "sweep": [], "links": {}}
    try:
        dist.init_process_group(runtime.backend, store=dist.PrefixStore(board.prefix + "pg/", board.store),
                                rank=identity.rank, world_size=identity.world_size,
                                timeout=datetime.timedelta(seconds=options.timeout_s))
        fault(identity.rank, STOP_AFTER_GROUP)
        # monitored_barrier exists on gloo only; with nccl it runs on a gloo side group.
        monitor = None if runtime.backend == "gloo" else dist.new_group(backend="gloo")
        result["collectives"] = check_collectives(identity.rank, identity.world_size, device,
                                                  options.timeout_s, monitor)
        sizes = options.sizes_for(device.type)
        if all(r["ok"] for r in result["collectives"]) and sizes:
            result["sweep"] = bandwidth_sweep(sizes, device, after_first=lambda: fault(identity.rank))
            result["links"] = link_times(min(max(sizes), MAX_LINK_BYTES), device)
    except Exception as error:
        result["collectives"].append({"name": "process group", "ok": False, "ms": 0.0,
                                      "detail": f"{type(error).__name__}: {one_line(error, 300)}"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


#: How long rank 0 stays, after posting the report, for the others to read it.
ACK_WAIT_S = 10.0


def stale_after_s(timeout_s: float) -> float:
    """How long rank 0 waits for a silent rank's heartbeat before naming it: half the timeout."""
    return max(2.0, timeout_s / 2)


def _collect(board: Board, records: list[dict[str, Any]], mine: dict[str, Any],
             timeout_s: float, report: dict[str, Any],
             checkpoint_bytes: int | None = None) -> list[Problem]:
    """Rank 0 gathers every rank's results (through the store: the group may be broken)."""
    mine_backend = records[0]["backend"]
    hosts = {r["rank"]: r["host"] for r in records}
    problems = []
    per_rank = {0: mine}
    deadline = time.monotonic() + timeout_s + 10.0
    silent, failed = [], []  # a silent rank is the cause: the others' failures only waited for it
    for rank in sorted(hosts):
        if rank != 0:
            per_rank[rank], still_s = wait_for_result(board, rank, deadline, stale_after_s(timeout_s))
            if per_rank[rank] is None:
                silent.append(Problem(rank, hosts[rank], "stopped answering during the collective "
                                      f"checks (no heartbeat for {still_s:.0f} s, no result): the "
                                      "process is stopped or hung, or its host is down"))
                continue
        report["collectives"][str(rank)] = per_rank[rank]["collectives"]
        failed += [Problem(rank, hosts[rank], f"{c['name']} failed: {c['detail']}")
                   for c in per_rank[rank]["collectives"] if not c["ok"]]
    problems += [] if silent else failed
    sweeps = {rank: r["sweep"] for rank, r in per_rank.items() if r and r["sweep"]}
    if len(sweeps) == len(hosts):
        report["bandwidth"] = summarize_sweep(sweeps, len(hosts))
        size = min(max(row["bytes"] for row in next(iter(sweeps.values()))), MAX_LINK_BYTES)
        report["links"] = summarize_links({rank: r["links"] for rank, r in per_rank.items()},
                                          hosts, size)
        problems += slow_link_problems(report["links"], mine_backend)
    report["silent_ranks"] = [problem.rank for problem in silent]
    answered = {rank: r for rank, r in per_rank.items() if r}
    problems += storage_problems({rank: r.get("storage") for rank, r in answered.items()}, hosts,
                                 len(hosts), checkpoint_bytes)
    problems += clock_problems({rank: r["clock_skew_s"] for rank, r in answered.items() if rank != 0},
                               hosts)
    return silent + problems


def _finish(board: Board | None, report: dict[str, Any], options: Options, started: float,
            followers: int) -> int:
    """Rank 0: print and write the report, post the end, let the followers read it."""
    report["ok"] = not report["problems"]
    report["seconds"] = round(time.monotonic() - started, 3)
    sys.stdout.write("\n".join(format_report(report)) + "\n")
    sys.stdout.flush()
    write_json(options.json_path, report)
    if board is not None:
        try:
            board.post("report", {"ok": report["ok"]})
            # The store lives in this process: stay until the others have read the end.
            board.wait_for_tally("acks", followers, ACK_WAIT_S)
        except RendezvousError:
            pass
    return 0 if report["ok"] else 1


def _lead(board: Board, identity: Identity, runtime: Runtime, options: Options,
          report: dict[str, Any], started: float, phase: list[str]) -> int:
    phase[0] = "waiting for the other ranks to arrive"
    arrived = board.wait_for_ranks(identity.world_size, started + options.timeout_s)
    records = board.records(arrived)
    master = f"{identity.master_addr}:{identity.master_port}"
    problems = verdict(records, identity.world_size, options.timeout_s, master, board.strays())
    problems += shm_problems(records)
    report["ranks"] = records
    report["problems"] = [p.as_dict() for p in problems]
    # The token names this run's files in the checkpoint directory; the time is rank 0's clock.
    ruling = {"ok": not problems, "token": uuid.uuid4().hex, "time": time.time()}
    board.post("verdict", ruling)
    followers = board.arrivals() - 1
    if problems:
        return _finish(board, report, options, started, followers)
    phase[0] = "checking the collectives"
    mine = _group_checks(identity, runtime, board, options, ruling)
    phase[0] = "collecting the other ranks' results"
    problems = _collect(board, records, mine, options.timeout_s, report, options.checkpoint_bytes)
    report["problems"] = [p.as_dict() for p in problems]
    # A stopped rank will never read the end: do not wait for it.
    return _finish(board, report, options, started, followers - len(report.pop("silent_ranks")))


def _follow(board: Board, identity: Identity, runtime: Runtime, options: Options,
            host: str, phase: list[str]) -> int:
    phase[0] = "waiting for rank 0's verdict"
    # Rank 0 may have started up to one timeout later, and then waits one timeout.
    ruling = board.wait_for("verdict", time.monotonic() + 2 * options.timeout_s + 10.0)
    if ruling is not None:  # this clock against rank 0's, read within a poll of its posting
        ruling["skew_s"] = time.time() - ruling["time"]
    if ruling is None:
        print(Problem(identity.rank, host, "rank 0 posted no verdict within "
                      f"{2 * options.timeout_s + 10:g} s").line(), flush=True)
        return 1
    if ruling["ok"]:
        phase[0] = "checking the collectives"
        with Heartbeat(board, identity.rank):
            board.post(f"result/{identity.rank}",
                       _group_checks(identity, runtime, board, options, ruling))
    phase[0] = "waiting for rank 0's report"
    final = board.wait_for("report", time.monotonic() + 2 * options.timeout_s + 20.0)
    board.tally("acks")
    return 0 if final is not None and final["ok"] else 1


def run_rank(options: Options, environ: Mapping[str, str] | None = None) -> int:
    """The whole pre-flight of one rank; returns its exit status (0 ok, 1 problem)."""
    environ = os.environ if environ is None else environ
    started = time.monotonic()
    host = socket.gethostname()
    raw_rank = environ.get("RANK", "?").strip() or "?"
    phase = ["reading the launcher's variables"]
    start_watchdog(watchdog_limit_s(options), raw_rank, host, phase)
    try:
        identity = read_identity(environ)
        gpu_inventory(environ)  # an invalid simulated GPU count is reported here
        runtime = select_runtime(identity.local_world_size)
    except (IdentityError, ValueError) as error:
        print(Problem(raw_rank, host, str(error)).line(), flush=True)
        _leave_word(environ, raw_rank, host, str(error), options.timeout_s)
        return 1
    master = f"{identity.master_addr}:{identity.master_port}"
    report = new_report(identity.world_size, master, options.timeout_s, launcher_name(environ))
    board = None
    try:
        phase[0] = f"reaching the rendezvous endpoint {master}"
        store = None
        check_resolves(identity.master_addr, identity.master_port)
        if identity.rank == 0 and not identity.agent_store:
            store = host_store(identity, options.timeout_s)
        connect_ms = wait_for_endpoint(identity.master_addr, identity.master_port,
                                       started + options.timeout_s, options.timeout_s)
        store = store or join_store(identity, options.timeout_s)
        board = Board(store, key_prefix(environ))
        board.register(identity.rank, rank_facts(identity, runtime, environ, connect_ms))
        if identity.rank == 0:
            with Heartbeat(board, 0):  # the followers watch it (RootWatch)
                return _lead(board, identity, runtime, options, report, started, phase)
        with RootWatch(join_store(identity, options.timeout_s), board.prefix, options.timeout_s,
                       root_silent):
            return _follow(board, identity, runtime, options, host, phase)
    except RendezvousError as error:
        problem = Problem(identity.rank, host, str(error))
        if identity.rank != 0:
            print(problem.line(), flush=True)
            return 1
        report["problems"].append(problem.as_dict())
        return _finish(None, report, options, started, 0)
