"""The doctor's parts, in this process: facts, rendezvous, collectives, report, local, worker.

The command as a whole runs in subprocesses (test_main.py); here each
module is called directly, on synthetic inputs whose answer is known.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpguide.core.runtime import Runtime
from ddpguide.doctor import collectives, consistency, facts, local, rendezvous, report, sweep, worker
from ddpguide.doctor.options import Options, watchdog_limit_s

HOST = socket.gethostname()


def environ(**changes: str) -> dict[str, str]:
    """A consistent launcher environment for rank 1 of 2, with ``changes``."""
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


# ---------------------------------------------------------------- facts

def test_read_identity_defaults_as_for_one_node():
    identity = facts.read_identity(environ())
    assert identity == facts.Identity(rank=1, world_size=2, local_rank=1, local_world_size=2,
                                      group_rank=0, master_addr="10.0.0.1", master_port=29500,
                                      agent_store=False)
    two_nodes = facts.read_identity(environ(RANK="5", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4",
                                            TORCHELASTIC_USE_AGENT_STORE="True"))
    assert (two_nodes.local_rank, two_nodes.group_rank, two_nodes.agent_store) == (1, 1, True)


@pytest.mark.parametrize("changes, message", [
    ({"RANK": "2"}, "RANK=2 is not smaller than WORLD_SIZE=2"),
    ({"RANK": "7", "WORLD_SIZE": "4"}, "RANK=7 is not smaller than WORLD_SIZE=4"),
    ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"RANK": "-1"}, "RANK=-1 is negative"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port (1-65535)"),
])
def test_read_identity_names_the_variable_that_is_wrong(changes, message):
    with pytest.raises(facts.IdentityError) as caught:
        facts.read_identity(environ(**changes))
    assert str(caught.value) == message


def test_launcher_name_reads_the_environment_in_order():
    assert facts.launcher_name({}) == "by hand (environment variables)"
    assert facts.launcher_name({"SLURM_PROCID": "0"}) == "SLURM (srun)"
    assert facts.launcher_name({"SLURM_PROCID": "0", "TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert facts.launcher_name({"TORCHELASTIC_RUN_ID": "x", "DDPGUIDE_DOCTOR_LOCAL": "1"}) == \
        "ddpguide.doctor (local group)"


def test_gpu_inventory_simulated_and_real():
    assert facts.gpu_inventory({"DDPGUIDE_DOCTOR_FAKE_GPUS": "3"}) == (
        ["fake-gpu-0", "fake-gpu-1", "fake-gpu-2"], True)
    with pytest.raises(facts.IdentityError) as caught:
        facts.gpu_inventory({"DDPGUIDE_DOCTOR_FAKE_GPUS": "two"})
    assert str(caught.value) == "DDPGUIDE_DOCTOR_FAKE_GPUS='two' is not a whole number"
    ids, simulated = facts.gpu_inventory({})
    assert not simulated
    assert len(ids) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_rank_facts_two_simulated_gpus_for_four_ranks_means_the_cpu():
    env = environ(RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", DDPGUIDE_DOCTOR_FAKE_GPUS="2")
    record = facts.rank_facts(facts.read_identity(env), Runtime("gloo", "cpu"), env, 1.23456)
    assert (record["rank"], record["local_rank"], record["device"], record["gpu_id"]) == \
        (3, 3, "cpu", None)
    assert (record["gpus_visible"], record["gpus_simulated"], record["connect_ms"]) == (2, True, 1.235)
    # launcher variables only: the fake-GPU variable is not one of them
    assert record["variables"] == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert record["versions"]["torch"] == torch.__version__
    assert [p.message for p in consistency.cpu_with_gpu_problems([record])] == [
        "GPUs visible but this job would run on CPU: 2 GPU(s) for LOCAL_WORLD_SIZE=4 ranks, and "
        "nccl needs one GPU per rank (run one rank per GPU, or give each rank its own through "
        "CUDA_VISIBLE_DEVICES)"]
    forced = facts.rank_facts(facts.read_identity(env), Runtime("gloo", "cpu"),
                              {**env, "DDPGUIDE_DEVICE": "cpu"}, 1.0)
    assert consistency.cpu_with_gpu_problems([forced]) == []  # asked for: not a problem


def test_rank_facts_one_gpu_per_rank_through_cuda_visible_devices():
    def record(rank: int, visible: str) -> dict:
        env = environ(RANK=str(rank), WORLD_SIZE="8", LOCAL_WORLD_SIZE="8", LOCAL_RANK=str(rank),
                      DDPGUIDE_DOCTOR_FAKE_GPUS="1", CUDA_VISIBLE_DEVICES=visible)
        return facts.rank_facts(facts.read_identity(env), Runtime("gloo", "cpu"), env, 1.0)

    bound = [record(rank, str(rank)) for rank in (0, 5)]  # srun --gpus-per-task=1
    assert [(r["device"], r["gpu_id"]) for r in bound] == [("cuda:0 (fake)", "fake-gpu-0"),
                                                           ("cuda:0 (fake)", "fake-gpu-5")]
    assert consistency.gpu_problems(bound) == consistency.cpu_with_gpu_problems(bound) == []
    shared = [record(rank, "0") for rank in (0, 5)]  # both told "0": one GPU for two ranks
    assert [p.line() for p in consistency.gpu_problems(shared)] == [
        f"PROBLEM rank 5 (host {HOST}): LOCAL_RANK=5 would use GPU fake-gpu-0, as rank 0 "
        "(LOCAL_RANK=0) does: two ranks on one GPU (1 GPU(s) visible, LOCAL_WORLD_SIZE=8)"]


def test_nccl_versions_are_compared_across_ranks():
    env = environ(RANK="1")
    base = facts.rank_facts(facts.read_identity(env), Runtime("gloo", "cpu"), env, 1.0)
    rank0 = {**base, "rank": 0, "backend": "nccl", "versions": {**base["versions"], "nccl": "2.27.5"}}
    rank1 = {**base, "backend": "nccl", "versions": {**base["versions"], "nccl": "2.21.5"}}
    assert [p.line() for p in consistency.version_problems([rank0, rank1], rank0)] == [
        f"PROBLEM rank 1 (host {HOST}): nccl 2.21.5, but rank 0 has nccl 2.27.5"]
    assert consistency.version_problems([rank0, {**rank1, "versions": rank0["versions"]}], rank0) == []


def test_nccl_variables_are_compared_across_ranks():
    base = {"rank": 0, "host": HOST, "backend": "nccl"}
    rank0 = {**base, "nccl_variables": {"NCCL_IB_DISABLE": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"}}
    rank1 = {**base, "rank": 1, "nccl_variables": {"NCCL_IB_DISABLE": "0", "NCCL_DEBUG": "INFO",
                                                   "TORCH_NCCL_BLOCKING_WAIT": "1"}}
    assert [p.line() for p in consistency.nccl_variable_problems([rank0, rank1], rank0)] == [
        f"PROBLEM rank 1 (host {HOST}): NCCL_DEBUG 'INFO', but unset on rank 0",
        f"PROBLEM rank 1 (host {HOST}): NCCL_IB_DISABLE '0', but '1' on rank 0"]
    assert consistency.nccl_variable_problems([rank0, {**rank1, "nccl_variables": rank0["nccl_variables"]}],
                                              rank0) == []
    on_gloo = [{**r, "backend": "gloo"} for r in (rank0, rank1)]  # gloo never reads them
    assert consistency.nccl_variable_problems(on_gloo, on_gloo[0]) == []


def test_each_host_may_name_its_own_nccl_interface():
    """Chapter 15's nodes each set NCCL_SOCKET_IFNAME to their own interface: no problem
    across hosts, one between two ranks of one host."""
    rank0 = {"rank": 0, "host": "node0", "backend": "nccl", "nccl_variables": {"NCCL_SOCKET_IFNAME": "n0"}}
    rank1 = {**rank0, "rank": 1, "host": "node1", "nccl_variables": {"NCCL_SOCKET_IFNAME": "n1"}}
    assert consistency.nccl_variable_problems([rank0, rank1], rank0) == []
    assert [p.line() for p in consistency.nccl_variable_problems([rank0, {**rank1, "host": "node0"}], rank0)] == [
        "PROBLEM rank 1 (host node0): NCCL_SOCKET_IFNAME 'n1', but 'n0' on rank 0"]


def test_rank_facts_keep_the_nccl_variables_only():
    env = environ(RANK="1", NCCL_SOCKET_IFNAME="eth0", TORCH_NCCL_ASYNC_ERROR_HANDLING="3", NCCLX="no")
    record = facts.rank_facts(facts.read_identity(env), Runtime("gloo", "cpu"), env, 1.0)
    assert record["nccl_variables"] == {"NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


# ---------------------------------------------------------------- local

def test_a_local_rank_gets_what_a_launcher_gives(monkeypatch):
    from ddpguide.core.runtime import launcher_environment
    from ddpguide.launch.torchrun import agent_environment

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "left-over")  # an outer launcher's: not inherited
    env = agent_environment({**launcher_environment(1, 3, 29555, addr=local.HOST),
                             "DDPGUIDE_DOCTOR_LOCAL": "1"})  # as local.run_local builds it
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                                "DDPGUIDE_DOCTOR_LOCAL", "PYTHONUNBUFFERED")} == {
        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
        "DDPGUIDE_DOCTOR_LOCAL": "1", "PYTHONUNBUFFERED": "1"}
    assert "TORCHELASTIC_RUN_ID" not in env
    # the ranks read it back as intended
    assert facts.read_identity(env) == facts.Identity(1, 3, 1, 3, 0, "127.0.0.1", 29555, False)
    assert facts.launcher_name(env) == "ddpguide.doctor (local group)"


# ---------------------------------------------------------------- rendezvous

def test_key_prefix_separates_runs_and_restarts():
    assert rendezvous.key_prefix({}) == "ddpguide-doctor/none/0/"
    assert rendezvous.key_prefix({"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}) == \
        "ddpguide-doctor/job7/2/"


def test_wait_for_endpoint_gives_up_at_its_deadline_with_its_message():
    # bound and never listening: a connection is refused, and no other test's process can
    # take the port meanwhile (a port closed again could be, and then it answers)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(rendezvous.RendezvousError) as caught:
            rendezvous.wait_for_endpoint("127.0.0.1", port, started + 0.5, 0.5)
    elapsed = time.monotonic() - started
    assert 0.3 < elapsed < 3.0
    assert str(caught.value) == (f"nothing answered at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} "
                                 "within 0.5 s (connection refused); "
                                 "is rank 0 running, with the same MASTER_PORT?")


def test_wait_for_endpoint_returns_the_connect_time_of_a_listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        ms = rendezvous.wait_for_endpoint("127.0.0.1", server.getsockname()[1],
                                          time.monotonic() + 5.0, 5.0)
    assert 0.0 <= ms < 5000.0


def test_board_records_duplicates_strays_and_missing_keys():
    board = rendezvous.Board(dist.HashStore(), rendezvous.key_prefix({}))
    board.register(0, {"rank": 0, "pid": 10})
    board.register(1, {"rank": 1, "pid": 11})
    board.register(1, {"rank": 1, "pid": 12})  # a second process with RANK=1
    assert board.arrivals() == 3
    assert board.records([0, 1]) == [{"rank": 0, "pid": 10}, {"rank": 1, "pid": 11},
                                     {"rank": 1, "pid": 12}]
    assert board.wait_for_ranks(3, time.monotonic() + 0.2) == [0, 1]
    assert board.strays() == []
    board.add_stray("5", "b", "RANK=5 is not\nsmaller")
    assert board.strays() == ["5|b|RANK=5 is not smaller"]
    started = time.monotonic()
    assert board.wait_for("verdict", started + 0.2) is None
    assert time.monotonic() - started < 2.0
    board.post("verdict", {"ok": True})
    assert board.wait_for("verdict", time.monotonic()) == {"ok": True}


def test_a_rank_counted_but_not_yet_recorded_has_not_arrived():
    # register() takes its slot (count/R) before it writes the record: between the two, rank 0
    # must keep waiting, or it reads no record and reports the rank as missing.
    board = rendezvous.Board(dist.HashStore(), rendezvous.key_prefix({}))
    board.register(0, {"rank": 0})
    board.store.add(board.prefix + "count/1", 1)  # rank 1 half-way through register()
    assert board.wait_for_ranks(2, time.monotonic() + 0.2) == [0]
    board.store.set(board.prefix + "facts/1/1", '{"rank": 1}')
    assert board.wait_for_ranks(2, time.monotonic() + 0.2) == [0, 1]


# ---------------------------------------------------------------- collectives

def test_bus_factor_is_two_n_minus_one_over_n():
    assert [sweep.bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def test_summarize_sweep_takes_the_slowest_rank_per_size():
    def rows(*seconds):
        return [{"bytes": size, "iterations": 3, "seconds": s} for size, s in zip((4096, 2 ** 20), seconds)]
    per_rank = {0: rows(0.002, 0.010), 1: rows(0.004, 0.008), 2: rows(0.001, 0.008), 3: rows(0.002, 0.009)}
    summary = sweep.summarize_sweep(per_rank, 4)
    small, large = summary
    assert small["seconds"] == 0.004 and large["seconds"] == 0.010
    assert small["algbw_gbps"] == pytest.approx(4096 / 0.004 / 1e9)
    assert small["busbw_gbps"] == pytest.approx(1.5 * 4096 / 0.004 / 1e9)
    assert large["algbw_gbps"] == pytest.approx(0.1048576)
    assert large["busbw_gbps"] == pytest.approx(0.1572864)
    assert sweep.summarize_sweep({}, 4) == []


def test_on_nccl_a_slow_link_is_named_against_the_links_of_its_kind():
    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    size = 2 ** 20
    per_rank = {rank: {"from_left": size / 100e9, "from_right": size / 100e9} for rank in hosts}
    for rank, name in ((0, "from_left"), (1, "from_right"), (2, "from_left"), (3, "from_right")):
        per_rank[rank][name] = size / 10e9  # the four links between hosts move 10 GB/s
    per_rank[2]["from_left"] = size / 1e9  # the link 1 -> 2 (node-a -> node-b) moves 1 GB/s
    links = sweep.summarize_links(per_rank, hosts, size)
    assert len(links["links"]) == 8 and (links["slowest"]["src"], links["slowest"]["dst"]) == (1, 2)
    assert links["hosts"] == pytest.approx({"node-a": 10.0, "node-b": 10.0})
    assert links["slow_hosts"] == []  # 2 hosts: each host's fastest transfer crosses both links
    assert [p.line() for p in consistency.slow_link_problems(links, "nccl")] == [
        "PROBLEM rank 2 (host node-b): slow link: rank 1 (node-a) -> rank 2 (node-b) moves "
        "1.00 GB/s, under half the 10.00 GB/s of the median link between hosts"]
    assert consistency.slow_link_problems(links, "gloo") == []  # one link: the load, on gloo
    per_rank[2]["from_left"] = size / 10e9 * 1.5  # a little slower: noise, not a problem
    assert consistency.slow_link_problems(sweep.summarize_links(per_rank, hosts, size), "nccl") == []


def test_a_slow_host_link_is_named_on_every_backend_with_three_hosts():
    hosts = {0: "node0", 1: "node0", 2: "node1", 3: "node1", 4: "node2", 5: "node2"}
    size = 2 ** 20
    gbps = {("node0", "node0"): 2.0, ("node1", "node1"): 2.0, ("node2", "node2"): 2.0,
            ("node0", "node2"): 0.1, ("node2", "node0"): 0.1}  # node1's link: 0.005 GB/s
    per_rank = {}
    for rank, host in hosts.items():
        left, right = hosts[(rank - 1) % 6], hosts[(rank + 1) % 6]
        per_rank[rank] = {"from_left": size / 1e9 / gbps.get((left, host), 0.005),
                          "from_right": size / 1e9 / gbps.get((right, host), 0.005)}
    links = sweep.summarize_links(per_rank, hosts, size)
    assert links["hosts"] == pytest.approx({"node0": 0.1, "node1": 0.005, "node2": 0.1})
    expected = ["PROBLEM rank 2 (host node1): slow link: host node1 moves at most 0.005 GB/s to or "
                "from any other host (its fastest transfer), under half the median host's 0.100 GB/s"]
    assert [p.line() for p in consistency.slow_link_problems(links, "gloo")] == expected
    assert [p.line() for p in consistency.slow_link_problems(links, "nccl")] == expected
    lines = report._link_lines(links)
    assert lines[-4:] == ["hosts' links (each host's fastest transfer to or from another host):",
                          "  node0              0.100 GB/s", "  node1              0.005 GB/s",
                          "  node2              0.100 GB/s"]


def test_iterations_are_bounded():
    assert [sweep.iterations_for(s) for s in (4, 2 ** 20, 2 ** 24, 2 ** 30)] == [50, 32, 3, 3]


def test_checks_pass_in_a_group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        results = collectives.check_collectives(0, 1, torch.device("cpu"), 30.0)
        rows = sweep.bandwidth_sweep((4096, 16384), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert [r["name"] for r in results] == [*collectives.CHECKS, "monitored_barrier"]
    assert {"reduce", "gather", "scatter", "all_gather_single", "reduce_scatter_single",
            "all_to_all_single uneven", "batch_isend_irecv", "object collectives"} <= set(collectives.CHECKS)
    assert [(r["name"], r["detail"]) for r in results if not r["ok"]] == []
    assert [(r["bytes"], r["iterations"]) for r in rows] == [(4096, 50), (16384, 50)]
    assert all(r["seconds"] > 0 for r in rows)


def test_a_sweep_past_its_first_seconds_shows_each_size_on_stderr(capsys):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        quiet = sweep.bandwidth_sweep((4096,), torch.device("cpu"), progress_after_s=3600.0)
        assert capsys.readouterr() == ("", "")
        rows = sweep.bandwidth_sweep((4096, 16384), torch.device("cpu"), progress_after_s=0.0)
    finally:
        dist.destroy_process_group()
    captured = capsys.readouterr()
    assert captured.out == "" and len(quiet) == 1
    assert captured.err.splitlines() == [
        f"ddpguide doctor: all_reduce sweep {i + 1}/2: {row['bytes']} bytes, "
        f"{1e3 * row['seconds']:.3f} ms (rank 0's time)" for i, row in enumerate(rows)]


# ---------------------------------------------------------------- report

def rank_record(rank: int, pid: int, connect_ms: float) -> dict:
    return {"rank": rank, "world_size": 2, "local_rank": rank, "local_world_size": 2,
            "host": "node-a", "pid": pid, "launcher": "torchrun", "device": "cpu",
            "versions": {"torch": "2.14.1", "cuda": None, "nccl": None}, "backend": "gloo",
            "gpus_visible": 0, "gpus_simulated": False, "connect_ms": connect_ms}


def test_a_passing_report_prints_ranks_checks_sweep_and_summary():
    rep = report.new_report(2, "127.0.0.1:29500", 30.0, "torchrun")
    assert (rep["ok"], rep["problems"], rep["seconds"]) == (False, [], None)
    rep["ranks"] = [rank_record(1, 201, 12.34), rank_record(0, 200, 0.26)]
    rep["collectives"] = {"0": [{"name": "barrier", "ok": True, "detail": "", "ms": 0.5}],
                          "1": [{"name": "barrier", "ok": True, "detail": "", "ms": 1.25}]}
    rep["bandwidth"] = [{"bytes": 2 ** 20, "seconds": 0.002, "algbw_gbps": 0.524288,
                         "busbw_gbps": 0.524288}]
    rep["links"] = sweep.summarize_links({0: {"from_left": 0.001}, 1: {"from_left": 0.002}},
                                         {0: "node-a", 1: "node-a"}, 2 ** 20)
    rep["ok"], rep["seconds"] = True, 3.21
    assert report.format_report(rep) == [
        "ddpguide doctor: 2 rank(s) expected, rendezvous at 127.0.0.1:29500, timeout 30 s",
        "rank  host             local  device            pid  torch          nccl     backend   connect",
        "   0  node-a            0/2   cpu               200  2.14.1         -        gloo       0.3 ms",
        "   1  node-a            1/2   cpu               201  2.14.1         -        gloo      12.3 ms",
        "launcher: torchrun; WORLD_SIZE=2, MASTER_ADDR:MASTER_PORT=127.0.0.1:29500 on every rank; "
        "1 host(s): node-a; torch 2.14.1, CUDA -, gloo",
        "GPUs visible per host: node-a: 0",
        "collectives (each rank's result against the known one):",
        "  barrier                  ok    (1.2 ms)",
        "all_reduce sweep (float32, 2 ranks; algbw = bytes/time, busbw = algbw * 2(n-1)/n = algbw * 1.00):",
        "      size       time       algbw       busbw",
        "     1 MiB   2.000 ms  0.524 GB/s  0.524 GB/s",
        "ring links (send/recv of 1 MiB to each neighbour, both directions, all links at once):",
        "    0 -> 1             node-a -> node-a             0.524 GB/s",
        "    1 -> 0             node-a -> node-a             1.049 GB/s",
        "summary: OK: 2 rank(s) on 1 host(s) passed every check in 3.2 s; "
        "busbw at 1 MiB: 0.524 GB/s; slowest link 0 -> 1 (node-a -> node-a): 0.524 GB/s",
    ]


def test_a_failing_report_names_each_problem_and_counts_them():
    rep = report.new_report(3, "h:1", 5.0, "torchrun")
    rep["ranks"] = [rank_record(0, 200, 1.0)]
    rep["problems"] = [{"rank": 1, "host": "unknown", "message": "did not arrive"},
                       {"rank": 2, "host": "unknown", "message": "did not arrive"}]
    rep["collectives"] = {"0": [{"name": "all_reduce sum", "ok": False, "ms": 3.0,
                                 "detail": "got [1.0], expected [3.0]"}]}
    lines = report.format_report(rep)
    assert not any(line.startswith("launcher:") for line in lines)  # no agreement to claim
    assert lines[-4:] == ["  all_reduce sum           FAILED on rank 0: got [1.0], expected [3.0]",
                          "PROBLEM rank 1 (host unknown): did not arrive",
                          "PROBLEM rank 2 (host unknown): did not arrive",
                          "summary: 2 problem(s) found; exit status 1"]
    rep["seconds"] = 10.04
    assert report.summary_line(rep) == "summary: 2 problem(s) found in 10.0 s; exit status 1"


# ---------------------------------------------------------------- worker

def _cancel_watchdogs(before: set[threading.Thread]) -> list[float]:
    """Stop the watchdog timers run_rank started (they would end this process later)."""
    started = [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t not in before]
    for timer in started:
        timer.cancel()
    return [timer.interval for timer in started]


def test_run_rank_with_rank_outside_the_world_stops_at_once(capsys):
    options = Options(timeout_s=5.0, sizes=())
    before = set(threading.enumerate())
    started = time.monotonic()
    try:
        code = worker.run_rank(options, {"RANK": "3", "WORLD_SIZE": "2"})
    finally:
        intervals = _cancel_watchdogs(before)
    assert code == 1
    assert time.monotonic() - started < 5.0
    assert intervals == [watchdog_limit_s(options)]
    assert capsys.readouterr().out.splitlines() == [
        f"PROBLEM rank 3 (host {HOST}): RANK=3 is not smaller than WORLD_SIZE=2"]


def test_run_rank_leaves_word_for_rank_0_in_the_store(capsys):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=10))
    env = {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_RUN_ID": "parts"}
    before = set(threading.enumerate())
    try:
        code = worker.run_rank(Options(timeout_s=5.0, sizes=()), env)
    finally:
        _cancel_watchdogs(before)
    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        f"PROBLEM rank 5 (host {HOST}): RANK=5 is not smaller than WORLD_SIZE=2"]
    board = rendezvous.Board(store, rendezvous.key_prefix(env))
    assert board.strays() == [f"5|{HOST}|RANK=5 is not smaller than WORLD_SIZE=2"]


# ---------------------------------------------------------------- storage, /dev/shm, clocks

def test_checkpoint_directory_shared_writable_and_large_enough(tmp_path):
    from ddpguide.doctor import storage

    shared, other = tmp_path / "shared", tmp_path / "node-b-local"
    shared.mkdir(), other.mkdir()
    # ranks 0 and 1 see one directory; rank 2 gets a directory of its own (another node's disk)
    for rank, folder in ((0, shared), (1, shared), (2, other)):
        (folder / f".ddpguide-doctor-tok-rank{rank}").write_text("x")
    found = {rank: storage.probe_directory(folder, "tok", rank, 3, wait_s=0.5)
             for rank, folder in ((0, shared), (1, shared), (2, other))}
    assert [found[r]["seen"] for r in range(3)] == [[0, 1], [0, 1], [2]]
    hosts = {0: "a", 1: "a", 2: "b"}
    lines = [p.line() for p in storage.storage_problems(found, hosts, 3, None)]
    assert lines[2] == (f"PROBLEM rank 2 (host b): checkpoint directory {other} is not the directory "
                        "the other ranks write to: this rank does not see the files of ranks 0, 1 "
                        "(a checkpoint needs one directory that every rank sees)")
    assert len(lines) == 3
    shared_only = {r: found[r] for r in (0, 1)}
    assert storage.storage_problems(shared_only, hosts, 2, None) == []
    huge = 2 ** 60  # more than any disk: one checkpoint would not fit
    assert [p.message.split(" has ")[1].endswith(f"than one checkpoint ({storage.format_size(huge)})")
            for p in storage.storage_problems(shared_only, hosts, 2, huge)] == [True, True]
    # /proc takes no new files, even from root: a directory this rank cannot write
    result = storage.probe_directory(Path("/proc"), "tok", 0, 1, wait_s=0.2)
    assert result["write_error"] is not None
    assert storage.storage_problems({0: result}, {0: "a"}, 1, None)[0].message == (
        f"checkpoint directory /proc is not writable ({result['write_error']})")


def test_small_dev_shm_on_nccl_and_clock_skew_are_problems():
    from ddpguide.doctor import storage

    records = [{"rank": 0, "host": "a", "backend": "nccl", "shm_bytes": 64 * 2 ** 20},
               {"rank": 1, "host": "b", "backend": "nccl", "shm_bytes": 32 * 2 ** 30},
               {"rank": 2, "host": "c", "backend": "gloo", "shm_bytes": 64 * 2 ** 20}]
    assert [p.line() for p in storage.shm_problems(records)] == [
        "PROBLEM rank 0 (host a): /dev/shm is 64.0 MiB, below 512.0 MiB: nccl's shared-memory "
        "transport fails with it (in a container: --ipc=host or --shm-size)"]
    assert storage.shm_bytes("/no/such/dir") is None
    assert [p.line() for p in storage.clock_problems({1: 0.3, 2: -12.5}, {1: "b", 2: "c"})] == [
        "PROBLEM rank 2 (host c): wall clock -12.5 s from rank 0's (more than 5 s: logs of "
        "different hosts will not line up; run NTP)"]


def test_fault_injection_stops_only_the_rank_it_names(monkeypatch):
    import os
    import signal

    from ddpguide.doctor import watch

    sent = []

    class Watched:  # the module's os, with os.kill recorded instead of sent
        def __getattr__(self, name):
            return getattr(os, name)

        def kill(self, pid, sig):
            sent.append((pid, sig))

    monkeypatch.setattr(watch, "os", Watched())
    monkeypatch.setenv(watch.STOP_AFTER_GROUP, " 1 ")
    watch.fault(0, watch.STOP_AFTER_GROUP)  # not rank 1: returns at once
    assert sent == []
    watch.fault(1, watch.STOP_AFTER_GROUP)  # rank 1 stops itself
    assert sent == [(os.getpid(), signal.SIGSTOP)]
    monkeypatch.delenv(watch.STOP_VARIABLE, raising=False)
    watch.fault(1)  # the sweep's variable is unset
    assert sent == [(os.getpid(), signal.SIGSTOP)]


# ---------------------------------------------------------------- a rank's GPU

@pytest.mark.multiprocess  # a stand-in nvidia-smi
def test_gpu_health_asks_nvidia_smi_for_this_gpu_only(tmp_path, monkeypatch):
    from ddpguide.doctor import gpu

    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu.gpu_processes("GPU-AB12") is None  # no nvidia-smi: not checked, not a problem
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'GPU-ab12, 4242, other_job, 2048'\n"
                      "echo 'GPU-cd34, 4343, elsewhere, 10'\necho 'GPU-ab12, 77, [N/A], [N/A]'\n")
    script.chmod(0o755)
    assert gpu.gpu_processes("GPU-AB12") == [{"pid": 4242, "name": "other_job", "used_mib": 2048},
                                             {"pid": 77, "name": "[N/A]", "used_mib": None}]
    assert gpu.gpu_processes("ab12") == gpu.gpu_processes("GPU-AB12")  # torch's UUID form
    simulated = gpu.gpu_health("fake-gpu-0", 0, True, {})
    assert simulated == {"processes": [], "free_bytes": 80 * 2**30, "total_bytes": 80 * 2**30,
                         "matmul_error": 0.0}
    state = {gpu.FAKE_STATE_VARIABLE: "free=2G,total=16G,matmul_error=0.5"}
    assert gpu.gpu_health("fake-gpu-0", 0, True, state)["free_bytes"] == 2 * 2**30
    with pytest.raises(ValueError, match="unknown key 'speed'"):
        gpu.fake_state({gpu.FAKE_STATE_VARIABLE: "speed=3"})
    with pytest.raises(ValueError, match="'free=lots' is not free=NUMBER"):
        gpu.fake_state({gpu.FAKE_STATE_VARIABLE: "free=lots"})
    # the real path, with the CUDA calls stood in for: memory from mem_get_info, the product on the device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(gpu, "matmul_error", lambda device: 1e-3 if device.type == "cuda" else 0.0)
    assert gpu.gpu_health("GPU-ab12", 0, False, {}) == {
        "processes": [{"pid": 4242, "name": "other_job", "used_mib": 2048},
                      {"pid": 77, "name": "[N/A]", "used_mib": None}],
        "free_bytes": 70 * 2**30, "total_bytes": 80 * 2**30, "matmul_error": 1e-3}
    rows = [{"rank": 0, "host": "a", "gpus_visible": 1, "gpus_simulated": True,
             "gpu_id": "fake-gpu-0", "gpu_health": simulated}]
    assert report._gpu_lines(rows) == [
        "GPUs visible per host: a: 1 simulated",
        "each rank's GPU (free memory, other processes by nvidia-smi, a float64 matmul against the CPU):",
        "  rank   0  fake-gpu-0               80.0 of 80.0 GiB free, 0 other process(es), matmul error 0.0e+00"]

