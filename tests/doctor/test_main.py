"""python -m ddpguide.doctor end to end: healthy groups pass, broken ones fail fast and clearly."""

from __future__ import annotations

import json
import re
import socket
import sys

import pytest

from ddpguide.core.processes import ephemeral_port as free_port
from tests.doctor.doctor_runs import STARTUP_ALLOWANCE_S, by_hand, doctor, finish, start

HOST = socket.gethostname()
TIMEOUT = 5  # the doctor's --timeout in the failing cases


def summary_seconds(stdout: str) -> float:
    """Rank 0's own measure of its run, from the summary line."""
    return float(re.search(r"^summary: .* in ([\d.]+) s", stdout, re.M).group(1))


def hand_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}


def check_healthy(stdout: str, world: int) -> None:
    lines = stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("rank  host")))
    assert [int(line.split()[0]) for line in lines[table + 1: table + 1 + world]] == list(range(world))
    for name in ("all_reduce sum", "all_reduce max", "broadcast", "all_gather", "reduce_scatter",
                 "all_to_all", "send/recv ring", "reduce", "gather", "scatter",
                 "all_gather_single", "reduce_scatter_single", "all_to_all_single uneven",
                 "batch_isend_irecv", "object collectives", "barrier", "monitored_barrier",
                 *([f"sub-groups 2x{world // 2}"] if world >= 4 else [])):
        assert re.search(rf"^  {re.escape(name)} +ok ", stdout, re.M), name
    assert "PROBLEM" not in stdout
    assert re.search(rf"^summary: OK: {world} rank\(s\) on 1 host\(s\) passed every check", stdout, re.M)


def test_healthy_local_group_of_two_with_json(tmp_path):
    report_path = tmp_path / "doctor.json"
    done = doctor(["--json", str(report_path)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.match(r"ddpguide doctor: no launcher variables \(RANK is unset\): starting a local "
                    r"group of 2 rank\(s\) on 127\.0\.0\.1:\d+\n", done.stdout)
    check_healthy(done.stdout, 2)
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["problems"] == [] and len(report["ranks"]) == 2
    assert [row["bytes"] for row in report["bandwidth"]] == [4096 * 4 ** i for i in range(7)]
    for row in report["bandwidth"]:  # nccl-tests: busbw = algbw * 2(n-1)/n, here n = 2
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
    assert {r["name"] for r in report["collectives"]["1"]} >= {"reduce_scatter", "all_to_all"}
    assert sorted((link["src"], link["dst"]) for link in report["links"]["links"]) == [(0, 1), (1, 0)]
    assert all(link["gbps"] > 0 for link in report["links"]["links"])
    assert re.search(r"^ring links \(send/recv of 16 MiB", done.stdout, re.M)


def test_healthy_local_group_of_four():
    done = doctor(["--nproc", "4", "--sizes", "4K,64K"])
    assert done.returncode == 0, done.stdout + done.stderr
    check_healthy(done.stdout, 4)
    assert "busbw = algbw * 2(n-1)/n = algbw * 1.50" in done.stdout


def test_healthy_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "ddpguide.doctor", "--sizes", "4K"]
    done = finish([start(command)], STARTUP_ALLOWANCE_S + 60)[0]
    assert done.returncode == 0, done.stdout + done.stderr
    check_healthy(done.stdout, 2)
    assert "launcher: torchrun;" in done.stdout


def test_wrong_master_port_fails_on_both_sides():
    port, wrong = free_port(), free_port()
    rank0, rank1 = by_hand([hand_env(0, 2, port), hand_env(1, 2, wrong)],
                           ["--timeout", str(TIMEOUT)], STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    assert rank1.returncode == 1 and rank0.returncode == 1
    assert rank1.lines() == [
        f"PROBLEM rank 1 (host {HOST}): nothing answered at MASTER_ADDR:MASTER_PORT=127.0.0.1:{wrong} "
        f"within {TIMEOUT} s (connection refused); is rank 0 running, with the same MASTER_PORT?"]
    assert (f"PROBLEM rank 1 (host unknown): did not arrive at 127.0.0.1:{port} within {TIMEOUT} s "
            f"(WORLD_SIZE=2; arrived: ranks 0)") in rank0.lines()
    assert TIMEOUT <= summary_seconds(rank0.stdout) < TIMEOUT + 3


def test_unresolvable_master_addr_is_one_line_on_every_rank():
    port, host = free_port(), "no-such-host.invalid"
    ranks = by_hand([hand_env(0, 2, port, MASTER_ADDR=host), hand_env(1, 2, port, MASTER_ADDR=host)],
                    ["--timeout", str(TIMEOUT)], STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    for rank, done in enumerate(ranks):
        assert done.returncode == 1
        problems = [line for line in done.lines() if line.startswith("PROBLEM")]
        assert len(problems) == 1 and re.fullmatch(
            rf"PROBLEM rank {rank} \(host {re.escape(HOST)}\): MASTER_ADDR={host} does not resolve "
            r"\(.+\)", problems[0]), done.stdout
        assert "frame #" not in done.stdout + done.stderr  # no C++ stack
    assert summary_seconds(ranks[0].stdout) < TIMEOUT


def test_missing_rank_is_named_and_written_to_json(tmp_path):
    port = free_port()
    report_path = tmp_path / "doctor.json"
    rank0, rank1 = by_hand([hand_env(0, 3, port), hand_env(1, 3, port)],
                           ["--timeout", str(TIMEOUT), "--json", str(report_path)],
                           STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    assert (rank0.returncode, rank1.returncode) == (1, 1)
    expected = (f"PROBLEM rank 2 (host unknown): did not arrive at 127.0.0.1:{port} within {TIMEOUT} s "
                f"(WORLD_SIZE=3; arrived: ranks 0, 1)")
    assert expected in rank0.lines()
    assert re.fullmatch(r"summary: 1 problem\(s\) found in [\d.]+ s; exit status 1", rank0.lines()[-1])
    assert TIMEOUT <= summary_seconds(rank0.stdout) < TIMEOUT + 3
    assert rank1.stdout == ""  # rank 0 reports for everyone
    report = json.loads(report_path.read_text())
    assert not report["ok"] and report["problems"][0]["rank"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]


def test_rank_not_below_world_size():
    port = free_port()
    rank0, stray = by_hand([hand_env(0, 2, port), hand_env(2, 2, port, LOCAL_RANK="0")],
                           ["--timeout", str(TIMEOUT)], STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    line = f"PROBLEM rank 2 (host {HOST}): RANK=2 is not smaller than WORLD_SIZE=2"
    assert stray.returncode == 1 and stray.lines() == [line]
    assert rank0.returncode == 1
    assert line in rank0.lines()  # the stray left word in the store before it left
    assert (f"PROBLEM rank 1 (host unknown): did not arrive at 127.0.0.1:{port} within {TIMEOUT} s "
            f"(WORLD_SIZE=2; arrived: ranks 0)") in rank0.lines()


def test_gpus_visible_but_the_job_would_run_on_cpu():
    # One (simulated) GPU for two local ranks: nccl would refuse, so the job would run on gloo.
    done = doctor(["--timeout", str(TIMEOUT)], {"DDPGUIDE_DOCTOR_FAKE_GPUS": "1"},
                  timeout_s=STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    assert done.returncode == 1
    for rank in (0, 1):
        assert (f"PROBLEM rank {rank} (host {HOST}): GPUs visible but this job would run on CPU: "
                "1 GPU(s) for LOCAL_WORLD_SIZE=2 ranks, and nccl needs one GPU per rank (run one "
                "rank per GPU, or give each rank its own through CUDA_VISIBLE_DEVICES)") in done.lines()
    assert "collectives" not in done.stdout  # nothing runs on a misassigned world
    assert summary_seconds(done.stdout) < TIMEOUT


def test_two_local_ranks_told_to_share_one_gpu():
    done = doctor(["--timeout", str(TIMEOUT)],
                  {"DDPGUIDE_DOCTOR_FAKE_GPUS": "1", "CUDA_VISIBLE_DEVICES": "0"},
                  timeout_s=STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    assert done.returncode == 1
    assert (f"PROBLEM rank 1 (host {HOST}): LOCAL_RANK=1 would use GPU fake-gpu-0, as rank 0 "
            f"(LOCAL_RANK=0) does: two ranks on one GPU (1 GPU(s) visible, LOCAL_WORLD_SIZE=2)") in done.lines()
    assert summary_seconds(done.stdout) < TIMEOUT


def test_each_rank_s_gpu_is_checked_for_memory_other_processes_and_a_matmul(tmp_path):
    # Simulated GPUs (one per rank): what mem_get_info and the matmul would say comes from
    # DDPGUIDE_DOCTOR_FAKE_GPU_STATE, the processes from an nvidia-smi that lists another job.
    import os

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'fake-gpu-1, 4242, other_job, 2048'\n")
    smi.chmod(0o755)
    done = doctor(["--timeout", str(TIMEOUT)],
                  {"DDPGUIDE_DOCTOR_FAKE_GPUS": "2", "PATH": f"{tmp_path}:{os.environ['PATH']}",
                   "DDPGUIDE_DOCTOR_FAKE_GPU_STATE": "free=10G,total=80G,matmul_error=0.5"},
                  timeout_s=STARTUP_ALLOWANCE_S + 4 * TIMEOUT)
    assert done.returncode == 1
    problems = [line for line in done.lines() if line.startswith("PROBLEM")]
    assert problems == [
        f"PROBLEM rank 0 (host {HOST}): GPU fake-gpu-0 has 10.0 GiB free of 80.0 GiB (12%) before "
        "the job starts: another process holds the rest",
        f"PROBLEM rank 0 (host {HOST}): GPU fake-gpu-0 computed a 256 x 256 float64 matmul with "
        "a relative error of 5.0e-01 against the CPU (at most 1e-09): a faulty GPU, driver or clock",
        f"PROBLEM rank 1 (host {HOST}): GPU fake-gpu-1 has 10.0 GiB free of 80.0 GiB (12%) before "
        "the job starts: another process holds the rest",
        f"PROBLEM rank 1 (host {HOST}): GPU fake-gpu-1 is also used by pid 4242 (other_job, 2048 "
        "MiB), not a rank of this job",
        f"PROBLEM rank 1 (host {HOST}): GPU fake-gpu-1 computed a 256 x 256 float64 matmul with "
        "a relative error of 5.0e-01 against the CPU (at most 1e-09): a faulty GPU, driver or clock"]
    assert summary_seconds(done.stdout) < TIMEOUT


def test_srun_tasks_without_rank_are_told_how_to_run_it():
    done = doctor([], {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, timeout_s=60)
    assert done.returncode == 1
    assert done.lines() == [
        f"PROBLEM rank ? (host {HOST}): srun task 2 of 4 has no RANK: run the doctor under torchrun "
        "in the job (as cluster/slurm_torchrun.sbatch runs training), or export RANK, WORLD_SIZE, "
        "MASTER_ADDR and MASTER_PORT for each task"]


def test_a_rank_stopped_in_the_middle_of_the_sweep_is_named_first_within_the_bound():
    # Rank 1 stops itself (SIGSTOP) after the sweep's first size: rank 0's next all-reduce times
    # out after TIMEOUT s; then rank 1's heartbeat has stood still, so rank 0 names it (not
    # itself) and ends, well within the stated bound (every rank's watchdog, 3 x timeout + 120 s).
    import subprocess

    port = free_port()
    ranks = [start([sys.executable, "-m", "ddpguide.doctor", "--timeout", str(TIMEOUT),
                    "--sizes", "4K,64K,1M"], hand_env(r, 2, port, DDPGUIDE_DOCTOR_STOP_IN_SWEEP="1"))
             for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=STARTUP_ALLOWANCE_S + 3 * TIMEOUT + 20)
        stopped = ranks[1].poll() is None  # still there, stopped
    except subprocess.TimeoutExpired:
        out, stopped = "rank 0 did not finish", None
    finally:
        kill_all(ranks)
    assert stopped, out
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems and re.fullmatch(
        rf"PROBLEM rank 1 \(host {re.escape(HOST)}\): stopped answering during the collective "
        r"checks \(no heartbeat for \d+ s, no result\): the process is stopped or hung, or its "
        r"host is down", problems[0]), out
    assert ranks[0].returncode == 1
    assert summary_seconds(out) < 3 * TIMEOUT + 10


def kill_all(ranks) -> None:
    """SIGKILL each rank's process group (its torch threads and children too), and reap it."""
    import os
    import signal

    for process in ranks:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_rank_0_stopped_after_the_group_forms_is_named_within_about_one_timeout():
    # Rank 0 stops itself (SIGSTOP) right after the process group forms, with the store it hosts.
    # Rank 1 must name rank 0 within about one timeout of that moment, not wait for a report.
    import subprocess
    import time

    timeout = TIMEOUT
    port = free_port()
    ranks = [start([sys.executable, "-m", "ddpguide.doctor", "--timeout", str(timeout),
                    "--sizes", "4K"], hand_env(r, 2, port, DDPGUIDE_DOCTOR_STOP_AFTER_GROUP="0"))
             for r in (0, 1)]
    try:
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S
        while not _stopped(ranks[0].pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stopped(ranks[0].pid), "rank 0 never stopped"
        stopped_at = time.monotonic()
        try:
            out, _ = ranks[1].communicate(timeout=2 * timeout + 30)
        except subprocess.TimeoutExpired:
            out = "rank 1 did not finish"
        waited = time.monotonic() - stopped_at
    finally:
        kill_all(ranks)
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems and re.fullmatch(
        rf"PROBLEM rank 0 \(host {re.escape(HOST)}\): stopped answering \(no heartbeat for {timeout} s\): "
        r"the process is stopped or hung, or its host is down",
        problems[0]), out
    assert ranks[1].returncode == 1
    assert waited < timeout + 5, (waited, out)


def test_local_group_with_a_rank_stopped_in_the_sweep_ends_soon_after_rank_0():
    # Rank 1 stops itself in the sweep: the parent must not wait for it after rank 0 has
    # reported; the whole run ends, rank 1 named (never rank 0), nothing left behind.
    done = doctor(["--timeout", str(TIMEOUT), "--sizes", "4K,64K,1M"],
                  {"DDPGUIDE_DOCTOR_STOP_IN_SWEEP": "1"}, timeout_s=STARTUP_ALLOWANCE_S + 3 * TIMEOUT + 30)
    problems = [line for line in done.lines() if line.startswith("PROBLEM")]
    assert problems and problems[0].startswith(f"PROBLEM rank 1 (host {HOST}): stopped answering during "
                                               "the collective checks"), done.stdout
    assert not [line for line in problems if line.startswith("PROBLEM rank 0")], done.stdout
    assert done.returncode == 1
    assert summary_seconds(done.stdout) < 3 * TIMEOUT + 10
