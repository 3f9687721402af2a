"""Elastic training: the demo end to end, the store as a single point of failure, bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpguide.core.checkpoint import save_checkpoint, training_state
from ddpguide.core.models import ConvNet
from ddpguide.core.processes import alive, descendants, signal_all
from ddpguide.elastic.__main__ import main
from ddpguide.elastic.demo import MIN_EPOCHS
from ddpguide.elastic.settings import (
    STORE_SHARING_WORKAROUND,
    AgentSettings,
    UsageError,
    parse_endpoint,
    parse_nnodes,
)

ROOT = Path(__file__).resolve().parents[2]


def _run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python -m ddpguide.elastic ARGS`` in a session of its own; its whole tree dies after."""
    process = subprocess.Popen([sys.executable, "-m", "ddpguide.elastic", *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [process.pid, *descendants(process.pid)]
        os.killpg(process.pid, signal.SIGKILL)
        signal_all(tree, signal.SIGKILL)
        out, err = process.communicate(timeout=10)
        pytest.fail(f"{args} did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        tree = descendants(process.pid) if process.poll() is None else []
        signal_all(tree, signal.SIGKILL)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _still_a_worker(pid: int) -> bool:
    """Alive and still one of ours (pids wrap around quickly on a busy machine)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return alive(pid) and (b"forkserver" in cmdline or b"ddpguide" in cmdline)


def _assert_all_dead(pids: list[int], grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while any(_still_a_worker(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if _still_a_worker(p)]
    signal_all(survivors, signal.SIGKILL)  # fail, but leave nothing behind
    assert not survivors, "worker processes outlived their agent"


@pytest.mark.timeout(200)
def test_demo_joins_leaves_crashes_and_finishes_every_epoch_once(tmp_path):
    report_path, workdir = tmp_path / "report.json", tmp_path / "run"
    # the fewest epochs the demo takes: every check holds for any
    result = _run_cli(["--report", str(report_path), "--workdir", str(workdir), "--epochs", str(MIN_EPOCHS)],
                      timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())

    # World sizes: 2, then 4 after the join, 2 after the departure, 2 again after the crash.
    assert report["world_sizes"] == [2, 4, 2, 2]
    assert [r["cause"] for r in report["recoveries"]] == ["join", "leave", "crash"]
    groups = report["groups"]
    # The join costs no restart, the leave and the crash one each on node A; a start whose rank 0
    # found MASTER_PORT taken one more (none in most runs; counted from the node logs, test_report.py).
    a_restarts = [g["restart"] for g in groups if g["node"] == "A"]
    failed = report["failed_starts"]
    assert groups[1]["restart"] <= failed[groups[1]["node"]], (groups, failed)
    assert a_restarts[-1] == 2 + failed["A"] and a_restarts[-1] > a_restarts[-2] > a_restarts[0], (groups, failed)
    # Every epoch exactly once, in order; a resumed group starts after the saved epoch.
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(report["settings"]["epochs"]))
    assert report["epochs_reported_twice"] == []
    assert report["finished"]
    starts = [g["start_epoch"] for g in groups]
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    # Each epoch ran at the world size of the group that was running then.
    for e in epochs:
        group = [g for g in groups if g["start_epoch"] <= e["epoch"]][-1]
        assert e["world_size"] == group["world_size"], (e, group)
    assert {e["world_size"] for e in epochs} == {2, 4}
    for event in report["events"]:
        assert {"time_s", "event", "world_size", "epoch"} <= set(event)
    assert "summary" in result.stdout and "each exactly once" in result.stdout

    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    _assert_all_dead([e["pid"] for e in events if e["event"] == "spawned"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("external_store", [False, True], ids=["store-in-node-A", "separate-store"])
@pytest.mark.multiprocess
def test_losing_the_store_host_ends_the_job_unless_the_store_is_separate(external_store):
    from ddpguide.elastic.failover import lose_store_host

    outcome = lose_store_host(external_store)
    if external_store:
        assert outcome["survived"], outcome
        # 2s while B starts up, 4s together, then 2s on B alone to the end.
        runs = "".join(str(size) for _, size in outcome["epochs"])
        assert re.fullmatch(r"2*4+2+", runs), outcome
        assert [e for e, _ in outcome["epochs"]] == list(range(len(outcome["epochs"])))
    else:
        assert not outcome["survived"] and outcome["b_exit_code"] != 0, outcome
        assert "RendezvousConnectionError" in outcome["b_error"], outcome
    _assert_all_dead(outcome["worker_pids"])


def test_settings_parse_and_build_the_torchrun_command():
    assert parse_nnodes("1:3") == (1, 3) and parse_nnodes("2") == (2, 2)
    assert parse_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    settings = AgentSettings(nnodes="1:3", nproc_per_node=4, rdzv_endpoint="h:1234").validate()
    args = settings.torchrun_args()
    assert "--nnodes=1:3" in args and "--rdzv-backend=c10d" in args
    assert any(a.startswith("--rdzv-conf=") and "last_call_timeout=2" in a for a in args)
    assert settings.environment() == STORE_SHARING_WORKAROUND
    assert AgentSettings(share_store=True).environment() == {}
    with pytest.raises(UsageError, match="whole number"):
        AgentSettings(rdzv_conf={"last_call_timeout": "0.5"}).validate()


def _occupied_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


NODE = ["node", "--nproc-per-node", "2", "--nnodes", "1:2", "--rdzv-id", "t"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [
    "nnodes", "nproc", "endpoint-form", "endpoint-port", "endpoint-occupied",
    "checkpoint-dir", "checkpoint-under-file", "checkpoint-other-model", "checkpoint-corrupt",
    "store-port", "demo-workdir", "demo-report", "unknown-option",
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_overwritten(case, tmp_path, capsys):
    ckpt = tmp_path / "ckpt.pt"
    endpoint = "127.0.0.1:29999"
    server = None
    args = [*NODE, "--rdzv-endpoint", endpoint, "--checkpoint", str(ckpt)]
    expect = ""
    if case == "nnodes":
        args[args.index("1:2")] = "3:1"
        expect = "--nnodes '3:1': the minimum (3) is larger than the maximum (1)"
    elif case == "nproc":
        args[args.index("2")] = "0"
        expect = "--nproc-per-node 0: must be at least 1"
    elif case == "endpoint-form":
        args[args.index(endpoint)] = "localhost"
        expect = "--rdzv-endpoint 'localhost': expected HOST:PORT"
    elif case == "endpoint-port":
        args[args.index(endpoint)] = "localhost:70000"
        expect = "port 70000 is outside 1-65535"
    elif case == "endpoint-occupied":
        server = _occupied_port()
        busy = f"127.0.0.1:{server.getsockname()[1]}"
        args[args.index(endpoint)] = busy
        expect = f"--rdzv-endpoint {busy}: port {server.getsockname()[1]} is in use by another program"
    elif case == "checkpoint-dir":
        args[-1] = str(tmp_path / "missing" / "ckpt.pt")
        expect = "does not exist"
    elif case == "checkpoint-under-file":
        (tmp_path / "file").write_text("x")
        args[-1] = str(tmp_path / "file" / "ckpt.pt")
        expect = "is not a directory"
    elif case == "checkpoint-other-model":
        model = ConvNet()
        save_checkpoint(training_state(3, model, torch.optim.SGD(model.parameters(), lr=0.1)), ckpt)
        expect = "does not fit this model"
    elif case == "checkpoint-corrupt":
        ckpt.write_bytes(b"\x80garbage")
        expect = "no readable checkpoint"
    elif case == "store-port":
        server = _occupied_port()
        args = ["store", "--port", str(server.getsockname()[1])]
        expect = "already in use"
    elif case == "demo-workdir":
        (tmp_path / "keep.txt").write_text("mine")
        args = ["--workdir", str(tmp_path)]
        expect = "must be a new or empty directory"
    elif case == "demo-report":
        args = ["--report", str(tmp_path / "missing" / "r.json")]
        expect = "does not exist"
    elif case == "unknown-option":
        args = [*args, "--frobnicate"]
        expect = "unrecognized arguments: --frobnicate"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    try:
        code = _exit_code(args)
    finally:
        if server is not None:
            server.close()
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured
    # "error: ..." for the checks of the elastic commands, "PROG: error: ..." from argparse
    assert len(lines) == 1 and " error: " in f" {lines[0]}" and expect in lines[0], lines
    assert captured.out == ""
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing overwritten


def _exit_code(args: list[str]) -> int:
    """What ``python -m ddpguide.elastic ARGS`` would exit with (argparse exits itself)."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


@pytest.mark.timeout(60)
def test_cli_bad_input_from_a_shell_and_help_warns_about_trust(tmp_path):
    result = _run_cli(["node", "--nnodes", "3:1", "--nproc-per-node", "2", "--rdzv-endpoint",
                       "127.0.0.1:29400", "--checkpoint", str(tmp_path / "c.pt")], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: --nnodes")
    for args in (["--help"], ["node", "--help"], ["store", "--help"]):
        helptext = _run_cli(args, timeout=60).stdout
        assert "trusted networks only" in " ".join(helptext.split()), args


def test_a_port_held_by_a_c10d_store_is_joined_not_refused():
    import datetime

    import torch.distributed as dist

    from ddpguide.elastic.checks import check_endpoint

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    check_endpoint(AgentSettings(rdzv_endpoint=f"127.0.0.1:{store.port}"))  # no UsageError


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_workers_die_with_their_agent(tmp_path):
    """SIGKILL of the agent alone (not its tree) takes the forkserver and every worker along."""
    from ddpguide.elastic.cluster import LocalCluster

    with LocalCluster(tmp_path, epochs=1000, step_delay=0.05, nnodes="1:2") as cluster:
        node = cluster.start_node("A", 2)
        deadline = time.monotonic() + 90
        while not any(e["event"] == "first_step" for e in cluster.poll() + cluster.all_events):
            assert time.monotonic() < deadline, cluster.log_tail("A")
            time.sleep(0.05)
        tree = descendants(node.process.pid)
        workers = [e["pid"] for e in cluster.all_events if e["event"] == "spawned"]
        assert set(workers) <= set(tree) and len(tree) >= 3  # forkserver and two workers
        try:
            os.kill(node.process.pid, signal.SIGKILL)
            node.process.wait(10)
            _assert_all_dead(tree)
        finally:
            signal_all(tree, signal.SIGKILL)  # the orphans a failure would leave


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_waiting_for_the_store_reports_an_agent_that_exited_at_once(tmp_path):
    from ddpguide.elastic.cluster import LocalCluster

    with LocalCluster(tmp_path, nnodes="3:2") as cluster:  # every agent refuses this
        cluster.start_node("A", 1)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"node A exited with code 2 before the rendezvous "
                                               r"store on port \d+ was up; its log ends:\n") as info:
            cluster.wait_for_store(45)
    assert "the minimum (3) is larger than the maximum (2)" in str(info.value)
    assert time.monotonic() - started < 30  # not the whole 45 s


@pytest.mark.timeout(60)
def test_a_port_bound_for_a_moment_by_another_agent_is_not_refused():
    """Something bound but not listening is no reason to refuse the endpoint."""
    from ddpguide.elastic.checks import check_endpoint

    with socket.socket() as probe:
        probe.bind(("", 0))
        check_endpoint(AgentSettings(rdzv_endpoint=f"127.0.0.1:{probe.getsockname()[1]}"))


def test_checking_the_endpoint_never_binds_its_port(monkeypatch):
    """Two agents start together: the one that is not the host must not hold the
    port even for a moment, or the host fails to bind its store there and
    quietly becomes a client of a store that never comes."""
    from ddpguide.elastic.checks import check_endpoint

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    bound = []
    real_bind = socket.socket.bind

    def spy(self, address):
        bound.append(address)
        return real_bind(self, address)

    monkeypatch.setattr(socket.socket, "bind", spy)
    check_endpoint(AgentSettings(rdzv_endpoint=f"127.0.0.1:{port}"))
    assert [a for a in bound if a[1] == port] == []

