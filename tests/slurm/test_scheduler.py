"""Slurm on the namespaces: inputs checked first, a working scheduler on 2 and 3 nodes, and
nothing left after any ending (a normal exit, ``down``, a driver killed before or after it
was ready).

The tests that start daemons need root, iproute2, Slurm and munge; elsewhere they skip
with the reason. The input checks run everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpguide.cluster import Spec, netns
from ddpguide.slurm import MissingPrerequisite, config, up
from ddpguide.slurm.__main__ import READY, main
from tests.file_snapshot import snapshot

pytestmark = pytest.mark.multiprocess  # the daemons, ip and the commands run as processes
ROOT = Path(__file__).resolve().parents[2]
needs_slurm = pytest.mark.skipif(config.missing_prerequisite() is not None,
                                 reason=str(config.missing_prerequisite()))



def running(pid: int | str) -> bool:
    """Process ``pid`` exists and has not ended (an ended daemon waits as a zombie until the
    machine's init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def daemons_running() -> list[str]:
    """The Slurm processes running on this machine (by ``comm``)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and running(proc.name) and (proc / "comm").read_text().strip() in (
                    "slurmctld", "slurmd", "slurmstepd", "munged"):
                out.append(proc.name)
        except OSError:
            pass
    return sorted(out)


def state() -> tuple[object, ...]:
    """What Slurm clusters own on this machine: their folders, records and daemons (other
    programs' network clusters come and go meanwhile, and are not counted)."""
    records = sorted(k for k, r in netns.read_records().items() if r.get("holder") == "slurm")
    return (snapshot(config.FOLDERS) if config.FOLDERS.exists() else None, records,
            daemons_running())


def left_of(run_id: str) -> list[str]:
    """Whatever of cluster ``run_id`` is still here: namespaces, hosts files, record, folder."""
    return [*netns.package_namespaces().get(run_id, []),
            *(str(p) for p in netns.package_configs().get(run_id, [])),
            *(str(p) for p in (netns.record_path(run_id), config.FOLDERS / run_id) if p.exists())]


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--nodes", "1"], "up: error: argument --nodes: must be >= 2, got 1 (see --help)"),
    (["up", "--cpus", "0"], "up: error: argument --cpus: must be >= 1, got 0 (see --help)"),
    (["up", "--link", "fast"],
     "error: argument --link: 'fast' is not a rate such as 1gbit, 400mbit or 100mbit"),
    (["run", "--cluster", "zzzzz", "--", "sinfo"],
     "error: argument --cluster: no live Slurm cluster 'zzzzz' (live: "),
    (["down", "--cluster", "zzzzz"], "error: argument --cluster: no live Slurm cluster 'zzzzz'"),
])
def test_bad_input_is_one_line_and_makes_nothing(argv, message, capsys, slurm_machine):
    before = state()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks exit; the package's return
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert state() == before


def test_without_root_or_slurm_one_line_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["up"]) == 2
    assert capsys.readouterr().err.startswith(
        "python -m ddpguide.slurm: error: network namespaces need root: run as root")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = config.shutil.which
    monkeypatch.setattr(config.shutil, "which",
                        lambda tool: None if tool in ("slurmctld", "srun") else real(tool) or "/x")
    assert main(["up"]) == 2
    assert capsys.readouterr().err == (
        "python -m ddpguide.slurm: error: slurmctld, srun not found: install Slurm and munge "
        "(apt-get install slurm-wlm munge)\n")
    with pytest.raises(MissingPrerequisite, match="^slurmctld, srun not found"):
        with up(Spec()):
            pass


def test_configuration_names_every_node_and_the_short_timeouts():
    _, nodes = __import__("ddpguide.cluster.spec", fromlist=["names"]).names("abcde", Spec(nodes=3))
    text = config.slurm_conf("abcde", nodes, 2, Path("/run/x"))
    assert "SlurmctldHost=node0(198.18.0.1)" in text
    assert [line for line in text.splitlines() if line.startswith("NodeName=")] == [
        f"NodeName=node{k} NodeAddr=198.18.0.{k + 1} CPUs=2 State=UNKNOWN" for k in range(3)]
    for setting in ("ReturnToService=2", "MpiDefault=none", f"SlurmdTimeout={config.SLURMD_TIMEOUT}",
                    "SlurmdSpoolDir=/run/x/spool-%n", "SlurmdPidFile=/run/x/slurmd-%n.pid",
                    "JobRequeue=0", f"MessageTimeout={config.MESSAGE_TIMEOUT}",
                    f"TCPTimeout={config.TCP_TIMEOUT}",
                    "SchedulerParameters=bf_interval=1,sched_interval=1"):
        assert setting in text.splitlines()


def test_a_cluster_removed_while_another_is_made_never_stops_its_munge(tmp_path, monkeypatch):
    """Two clusters at once (two test workers): the one removed last checks that no folder is
    left and stops munge; the one being made writes its folder and finds munge answering.
    Unlocked, the second can fall between the first's check and its kill, and its daemons
    then start with no munge. Under the lock, the stop ends first and the cluster being
    made finds munge stopped (and starts it)."""
    import threading
    from types import SimpleNamespace

    from ddpguide.cluster.spec import names
    from ddpguide.slurm import daemons, scheduler

    monkeypatch.setattr(daemons, "FOLDERS", tmp_path)
    monkeypatch.setattr(daemons, "MUNGE_RECORD", tmp_path / "munged.json")
    monkeypatch.setattr(daemons, "MUNGE_LOCK", tmp_path / "munged.lock")
    (tmp_path / "munged.json").write_text('{"pid": 4242, "start": 7}')
    monkeypatch.setattr(daemons.netns, "start_time", lambda pid: 7)
    events: list[str] = []
    monkeypatch.setattr(daemons, "ensure_munge", lambda: events.append("munge found answering"))
    cluster = SimpleNamespace(run_id="abcde", nodes=names("abcde", Spec(nodes=2))[1])
    made = threading.Event()

    def make() -> None:
        scheduler.make_folder(config.Layout(tmp_path / "abcde"), cluster, 2)  # type: ignore[arg-type]
        made.set()

    def stop_pid(pid: int) -> None:  # the moment between the check and the kill
        other = threading.Thread(target=make)
        other.start()
        made.wait(2.0)
        events.append(f"munged {pid} stopped")

    monkeypatch.setattr(daemons, "stop_pid", stop_pid)
    daemons.stop_munge_if_last()
    assert made.wait(10.0)
    assert events == ["munged 4242 stopped", "munge found answering"]
    assert (tmp_path / "abcde" / "slurm.conf").exists() and not (tmp_path / "munged.json").exists()


@needs_slurm
@pytest.mark.parametrize("nodes", [2, 3])
def test_up_gives_a_working_slurm_and_leaves_nothing(nodes, tmp_path, slurm_machine):
    before = state()
    with up(Spec(nodes=nodes)) as slurm:
        assert slurm.states() == {f"node{k}": "idle" for k in range(nodes)}
        done = slurm.run(["srun", f"-N{nodes}", "-l", "hostname"], 60, cwd=tmp_path)
        assert done.returncode == 0, done.errors
        # each task on its own node: its host name is the node's
        assert sorted(done.output.split("\n")[:-1]) == [f"{k}: node{k}" for k in range(nodes)]
        pids = [slurm.slurmd_pid(n) for n in slurm.nodes]
        assert all(pids) and slurm.layout.folder.is_dir()
    assert state() == before and left_of(slurm.run_id) == []
    assert not any(running(pid) for pid in pids)


def start_driver(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ddpguide.slurm", "up", "--hold", "120", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_ready(proc: subprocess.Popen[str]) -> str:
    """The run id, once the driver says Slurm is ready (bounded by the driver's own 60 s)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(READY):
            return lines[0].split()[1].rstrip(":")
    raise AssertionError(f"the driver ended before it was ready: {''.join(lines)}")


def command(*argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpguide.slurm", *argv], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@needs_slurm
def test_the_commands_run_on_node0_and_down_removes_everything(slurm_machine):
    before = state()
    proc = start_driver()
    try:
        run_id = wait_ready(proc)
        done = command("run", "--cluster", run_id, "--", "sinfo", "-h", "-o", "%D %T %P")
        assert (done.returncode, done.stdout) == (0, "2 idle nodes*\n"), done.stderr
        done = command("run", "--cluster", run_id, "--", "scontrol", "show", "hostnames", "node[0-1]")
        assert done.stdout == "node0\nnode1\n"
        down = command("down", "--cluster", run_id)
        assert (down.returncode, down.stdout) == (0, f"slurm cluster {run_id} removed\n")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert state() == before and left_of(run_id) == []


@needs_slurm
@pytest.mark.parametrize("when", ["ready", "starting"])
def test_a_killed_driver_is_cleaned_by_the_next_down(when, slurm_machine):
    before = state()
    proc = start_driver()
    try:
        if when == "ready":
            run_id = wait_ready(proc)
        else:  # killed while the daemons start: once its folder has the controller's pid file
            deadline = time.monotonic() + 60
            while not list(config.FOLDERS.glob("*/slurmctld.pid")):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            run_id = list(config.FOLDERS.glob("*/slurmctld.pid"))[0].parent.name
        proc.kill()
        proc.wait(timeout=10)
        assert daemons_running() and (config.FOLDERS / run_id).is_dir()  # left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    down = command("down", "--cluster", run_id)
    assert down.returncode == 0, down
    assert down.stdout.startswith("removed what dead drivers left: ") and run_id in down.stdout
    assert state() == before and left_of(run_id) == []
