"""Starting and stopping Slurm's daemons inside the nodes, and munge beside them.

``slurmctld`` runs on node 0, a ``slurmd`` on every node, each inside its
node's network namespace and under a UTS namespace of its own whose host name
is the node's name (``slurmctld`` refuses to start on a host that is not its
``SlurmctldHost``). Each daemon detaches and writes its pid file into the
cluster's folder; it is stopped by that pid file (SIGTERM, a bounded wait, then
SIGKILL), and a daemon a killed driver left is stopped with its node's
namespace (the network cluster removes every process inside a namespace).

munge, which signs every Slurm message, runs once for the machine (its socket
is in ``/run/munge``, which every namespace sees); it is started when it is not
running, and stopped again when the last Slurm cluster is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ddpguide.cluster import netns
from ddpguide.cluster.cluster import Cluster, netns_prefix
from ddpguide.cluster.spec import Node
from ddpguide.core.commands import write_atomically
from ddpguide.slurm.config import FOLDERS, Layout, daemon_script

START_TIMEOUT = 30.0
STOP_GRACE = 10.0
MUNGE_RECORD = FOLDERS / "munged.json"
#: where the munge lock is (not in FOLDERS: a command that only looks there leaves it as it was)
MUNGE_LOCK = Path("/run/lock/ddpguide-slurm-munged.lock")
#: the longest a holder keeps the lock: starting munged, or stopping it (SIGTERM, then SIGKILL)
LOCK_TIMEOUT = START_TIMEOUT + STOP_GRACE + 15.0
MUNGE_SOCKET_DIR = Path("/run/munge")
#: variables of the network cluster's commands that name one node's interface: a task that
#: Slurm starts on another node must not inherit them
NODE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: the simulated GPU machine's (ddpguide.core.gpusim_state), kept: a job sees the machine too
SIMULATION_VARIABLES = ("DDPGUIDE_SIMULATE_GPUS", "DDPGUIDE_SIMULATE_GPU_BF16", "DDPGUIDE_GPUSIM_LOG")


def client_env(layout: Layout, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of ``sinfo``/``srun``/``sbatch``: ``SLURM_CONF`` naming the cluster's
    configuration, this interpreter's folder first on ``PATH`` (for ``torchrun``)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in NODE_VARIABLES and not k.startswith(("DDPGUIDE_", "SLURM_"))
           or k in SIMULATION_VARIABLES}
    env["SLURM_CONF"] = str(layout.conf)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "/usr/bin:/bin")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def munge_works() -> bool:
    """munged answers: a credential is made and read back."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        made = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if made.returncode == 0:
            return subprocess.run(["unmunge"], input=made.stdout, capture_output=True,
                                  timeout=5).returncode == 0
    return False


@contextlib.contextmanager
def munge_lock(timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """This machine's munge lock (``flock`` on :data:`MUNGE_LOCK`) for the ``with`` block,
    waited for at most ``timeout`` s; released when its holder's process ends, however."""
    MUNGE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(MUNGE_LOCK, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{MUNGE_LOCK} held for over {timeout:.0f} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_munge() -> None:
    """Start munged as its own user when it does not answer, and remember that it was ours."""
    if munge_works():
        return
    MUNGE_SOCKET_DIR.mkdir(mode=0o755, exist_ok=True)
    os.system("chown munge:munge /run/munge")  # noqa: S605 - fixed command, no input
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"],
                   capture_output=True, timeout=START_TIMEOUT, check=True,
                   stdin=subprocess.DEVNULL)
    pid = int((MUNGE_SOCKET_DIR / "munged.pid").read_text().split()[0])
    FOLDERS.mkdir(parents=True, exist_ok=True)
    write_atomically(MUNGE_RECORD, json.dumps({"pid": pid, "start": netns.start_time(pid)}))
    if not munge_works():
        raise RuntimeError("munged started but does not answer (see /var/log/munge/munged.log)")


def stop_munge_if_last() -> None:
    """Stop the munged this package started, once no Slurm cluster's folder is left."""
    if not MUNGE_RECORD.exists():  # none started; one started from now on is another's
        return
    with munge_lock():
        if any(p.is_dir() for p in FOLDERS.glob("*")) or not MUNGE_RECORD.exists():
            return
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(MUNGE_RECORD.read_text())
            if netns.start_time(record["pid"]) == record["start"]:
                stop_pid(record["pid"])
        MUNGE_RECORD.unlink(missing_ok=True)


def start(cluster: Cluster, layout: Layout, node: Node, command: list[str]) -> None:
    """Start one daemon on ``node``; it detaches once it has written its pid file."""
    argv = [*netns_prefix(node), "unshare", "--uts", "sh", "-c",
            daemon_script(node.name, command)]
    done = subprocess.run(argv, env=client_env(layout), capture_output=True, text=True,
                          timeout=START_TIMEOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} on {node.name} did not start: "
                           f"{(done.stderr or done.stdout).strip()[-300:]}")


def start_all(cluster: Cluster, layout: Layout) -> None:
    """``slurmctld`` on node 0, then a ``slurmd`` on every node."""
    start(cluster, layout, cluster.nodes[0], ["slurmctld", "-f", str(layout.conf)])
    for node in cluster.nodes:
        start(cluster, layout, node, ["slurmd", "-f", str(layout.conf), "-N", node.name])


def pid_of(pid_file: Path, name: str) -> int | None:
    """The pid in ``pid_file`` when that process is still ``name`` (a reused pid is not)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return None
    return pid if comm == name else None


def stop_pid(pid: int) -> None:
    """SIGTERM, up to ``STOP_GRACE`` s, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if not netns.wait_for_exit([pid], STOP_GRACE if sig == signal.SIGTERM else 5.0):
            return


def stop_all(layout: Layout, nodes: list[Node]) -> None:
    """Stop every daemon by its pid file: the ``slurmd``s first, then the controller."""
    for pid_file, name in [*((layout.slurmd_pid(n), "slurmd") for n in nodes),
                           (layout.controller_pid, "slurmctld")]:
        pid = pid_of(pid_file, name)
        if pid is not None:
            stop_pid(pid)


def processes_naming(folder: Path) -> list[int]:
    """The processes whose command line names ``folder``: a daemon (``-f FOLDER/slurm.conf``)
    and the commands that start one (``ip netns exec ... sh -c "... slurmd -f ..."``), found
    even while one is between entering its namespace and writing its pid file."""
    found = []
    needle = os.fsencode(str(folder) + "/")
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


def kill_naming(folder: Path) -> None:
    """SIGKILL every process naming ``folder`` until none is left (a starter may exec its
    daemon meanwhile), at most 10 rounds."""
    for _ in range(10):
        pids = processes_naming(folder)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        netns.wait_for_exit(pids, 2.0)


def sinfo_states(cluster: Cluster, layout: Layout) -> dict[str, str]:
    """Each node's state as ``sinfo`` reports it (``idle``, ``allocated``, ``down*``, ...);
    empty when the controller does not answer."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        done = subprocess.run([*netns_prefix(cluster.nodes[0]), "sinfo", "-h", "-N", "-o", "%N %T"],
                              env=client_env(layout), capture_output=True, text=True, timeout=15)
        if done.returncode == 0:
            return dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return {}


def wait_until(cluster: Cluster, layout: Layout, wanted: dict[str, str] | str,
               timeout: float) -> dict[str, str]:
    """Poll ``sinfo`` (Slurm has no call that waits for a node's state) until every node is
    in state ``wanted`` (or each named node in its own); the last states seen."""
    want = wanted if isinstance(wanted, dict) else {n.name: wanted for n in cluster.nodes}
    deadline = time.monotonic() + timeout
    states = sinfo_states(cluster, layout)
    while not all(states.get(n, "").rstrip("*~#") == s for n, s in want.items()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes not {want} after {timeout:g} s: sinfo says {states or 'nothing'}")
        time.sleep(0.25)
        states = sinfo_states(cluster, layout)
    return states
