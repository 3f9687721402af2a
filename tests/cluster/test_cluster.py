"""The cluster's namespaces: inputs checked first, and nothing left after any ending.

The tests that make namespaces need root and ``ip``/``tc``; elsewhere they skip
with the reason. The input checks run everywhere.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide.cluster import MissingPrerequisite, Spec, netns, up
from ddpguide.cluster.__main__ import main
from ddpguide.cluster.spec import parse_rate

pytestmark = pytest.mark.multiprocess  # ip, tc and the command run as processes
ROOT = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(netns.missing_prerequisite() is not None,
                                reason=str(netns.missing_prerequisite()))


def namespaces_of(run_id: str) -> list[str]:
    return netns.package_namespaces().get(run_id, [])


def host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--nodes", "1"], "up: error: argument --nodes: must be >= 2, got 1 (see --help)"),
    (["up", "--link", "fast"],
     "error: argument --link: 'fast' is not a rate such as 1gbit, 400mbit or 100mbit"),
    (["up", "--link", "20gbit"], "error: argument --link: '20gbit' is outside 1mbit .. 10gbit"),
    (["up", "--slow-node", "1"], "error: argument --slow-node: --slow-node and --slow-link go together"),
    (["up", "--slow-node", "2", "--slow-link", "10mbit"],
     "error: argument --slow-node: 2 is not a node index in 0..1"),
    (["up", "--slow-node", "1", "--slow-link", "slow"],
     "error: argument --slow-link: 'slow' is not a rate such as 1gbit, 400mbit or 100mbit"),
    (["run", "node0", "--cluster", "zzzzz", "--", "true"],
     "error: argument --cluster: no live cluster 'zzzzz'"),
])
def test_bad_input_is_one_line_and_makes_nothing(argv, message, capsys):
    before = (sorted(netns.package_namespaces()), sorted(netns.read_records()))
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks exit; the package's return
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert (sorted(netns.package_namespaces()), sorted(netns.read_records())) == before


def test_rates_read_as_tc_reads_them():
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8
    assert parse_rate("2.5mbit") == 2_500_000


def test_without_root_or_tools_one_line_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["up"]) == 2
    assert capsys.readouterr().err == (
        "python -m ddpguide.cluster: error: network namespaces need root: run as root "
        "(e.g. sudo -E env PATH=$PATH ...) or read the saved bench run in "
        "book/measurements/cluster.json\n")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    with pytest.raises(MissingPrerequisite, match="^tc not found: install iproute2"):
        with up(Spec()):
            pass


@needs_root
def test_normal_exit_and_error_leave_nothing():
    host_name = socket.gethostname()
    with up(Spec(nodes=3, link="200mbit", slow_node=2, slow_link="50mbit")) as cluster:
        run_id = cluster.run_id
        assert len(namespaces_of(run_id)) == 4 and netns.record_path(run_id).exists()
        assert [n.rate_bits for n in cluster.nodes] == [2 * 10**8, 2 * 10**8, 5 * 10**7]
        [ping] = cluster.run([(cluster.nodes[0], [sys.executable, "-c",
                              "import socket; socket.create_connection(('198.18.0.3', 9), 2)"])], 10)
        assert "Connection refused" in ping.errors  # the other node answered: the link works
        names = cluster.run([(n, [sys.executable, "-c", "import socket; print(socket.gethostname(), "
                                  "socket.gethostbyname('node2'), socket.getfqdn())"])
                             for n in cluster.nodes], 10)
        # each node its own host name, and every node's name resolves inside the cluster
        assert [n.output.split() for n in names] == [
            [f"node{k}", "198.18.0.3", f"node{k}"] for k in range(3)]
        assert socket.gethostname() == host_name  # the machine's own name is untouched
        assert sorted(p.name for p in netns.package_configs()[run_id]) == [
            n.netns for n in cluster.nodes]
    assert namespaces_of(run_id) == [] and not netns.record_path(run_id).exists()
    assert run_id not in netns.package_configs()
    with pytest.raises(RuntimeError, match="inside"):
        with up(Spec()) as cluster:
            run_id = cluster.run_id
            raise RuntimeError("inside")
    assert namespaces_of(run_id) == [] and run_id not in host_links()


@needs_root
def test_a_failure_while_making_leaves_nothing(monkeypatch):
    real = netns.sh

    def failing(*argv, check=True):
        if argv[:1] == ("tc",):
            raise RuntimeError("tc refused")
        return real(*argv, check=check)
    monkeypatch.setattr(netns, "sh", failing)
    before = (set(netns.package_namespaces()), set(netns.package_configs()))
    with pytest.raises(RuntimeError, match="tc refused"):
        with up(Spec()):
            pass
    assert (set(netns.package_namespaces()), set(netns.package_configs())) == before


def start_command(hold: str = "30", ignoring_sigint: bool = False) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "ddpguide.cluster", "up", "--hold", hold]
    if ignoring_sigint:  # as a shell starts a background job: SIGINT ignored, kept by exec
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
    proc = subprocess.Popen(argv,
                            cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    first = proc.stdout.readline()  # "cluster ID: ..."
    assert first.startswith("cluster "), first
    for _ in range(4):
        proc.stdout.readline()
    return proc, first.split()[1].rstrip(":")


@needs_root
@pytest.mark.parametrize("ignoring_sigint", [False, True], ids=["foreground", "background-job"])
def test_ctrl_c_removes_everything(ignoring_sigint):
    proc, run_id = start_command(ignoring_sigint=ignoring_sigint)
    try:
        assert len(namespaces_of(run_id)) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert namespaces_of(run_id) == [] and not netns.record_path(run_id).exists()


@needs_root
def test_sigkilled_driver_is_cleaned_by_the_next_up_and_a_live_one_is_not():
    with up(Spec()) as live:
        proc, dead = start_command()
        proc.kill()
        proc.wait(timeout=10)
        assert len(namespaces_of(dead)) == 3  # a SIGKILLed driver cannot clean up
        with up(Spec()) as later:
            assert namespaces_of(dead) == [] and not netns.record_path(dead).exists()
            assert len(namespaces_of(live.run_id)) == 3  # the live driver's cluster is untouched
            assert later.run_id != live.run_id
    assert namespaces_of(live.run_id) == [] and dead not in host_links()
    assert {dead, live.run_id}.isdisjoint(netns.package_configs())  # their hosts files too
