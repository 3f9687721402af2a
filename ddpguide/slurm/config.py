"""A Slurm cluster's configuration, written for the nodes of a chapter-15 cluster.

Every file of one Slurm cluster lives in its own folder, ``FOLDERS/<run id>``
(the run id is the network cluster's): ``slurm.conf``, ``cgroup.conf``, the
controller's state, each node's spool folder, pid file and log (``%n`` is the
node's name in a path of ``slurm.conf``). Removing that folder removes all of it.

The timeouts are short so that a lost node shows in seconds: ``SlurmdTimeout``
seconds without an answer and the controller marks the node DOWN;
``ReturnToService=2`` takes it back once its ``slurmd`` registers again.
A requeued job waits ``cred_expire`` + 1 seconds before it is eligible again
(set short here); the scheduler then starts it at its next pass, every ``SCHED_INTERVAL``
seconds here. ``JobRequeue=0``: only a job submitted with ``--requeue`` goes back to the
queue when its node is lost.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ddpguide.cluster.spec import Node

#: one folder per Slurm cluster, named by its run id
FOLDERS = Path("/run/ddpguide-slurm")
PARTITION = "nodes"
SLURMD_TIMEOUT = 5  # seconds without an answer before the controller marks a node DOWN
SLURMCTLD_TIMEOUT = 5
MESSAGE_TIMEOUT = 5
TCP_TIMEOUT = 2  # seconds a TCP connect to a node may take (Slurm's default)
#: seconds between the scheduler's passes over pending jobs, the main loop's and the backfill's
#: (defaults 60 and 30): a requeued job becomes eligible by the clock, and only a pass starts it
SCHED_INTERVAL = 1
KILL_WAIT = 10  # seconds between a job's SIGTERM and its SIGKILL: time to checkpoint
#: a requeued job is eligible again this many seconds + 1 after its requeue (Slurm's default
#: is the job credential's lifetime, 120 s)
CRED_EXPIRE = 10
CGROUP_CONTROLLERS = ("freezer", "cpuset", "memory", "cpu", "cpuacct", "devices", "pids")
DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sinfo", "srun", "sbatch", "squeue", "scontrol", "scancel")


@dataclass(frozen=True)
class Layout:
    """Where one Slurm cluster's files are."""

    folder: Path

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def state(self) -> Path:
        return self.folder / "state"

    def spool(self, node: Node) -> Path:
        return self.folder / f"spool-{node.name}"

    @property
    def controller_pid(self) -> Path:
        return self.folder / "slurmctld.pid"

    def slurmd_pid(self, node: Node) -> Path:
        return self.folder / f"slurmd-{node.name}.pid"

    @property
    def controller_log(self) -> Path:
        return self.folder / "slurmctld.log"

    def slurmd_log(self, node: Node) -> Path:
        return self.folder / f"slurmd-{node.name}.log"


def layout(run_id: str) -> Layout:
    return Layout(FOLDERS / run_id)


def slurm_conf(run_id: str, nodes: list[Node], cpus: int, folder: Path) -> str:
    """``slurm.conf`` for ``nodes``, each with ``cpus`` CPUs, in one partition."""
    controller = nodes[0]
    lines = [
        f"ClusterName=ddpg{run_id}",
        f"SlurmctldHost={controller.name}({controller.address})",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=cred_expire={CRED_EXPIRE}",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool-%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        # the nodes' CPUs are the configuration's, not the machine's
        "SlurmdParameters=config_overrides",
        "MpiDefault=none", "SchedulerType=sched/backfill",
        "ReturnToService=2", "JobRequeue=0",
        f"SlurmdTimeout={SLURMD_TIMEOUT}", f"SlurmctldTimeout={SLURMCTLD_TIMEOUT}",
        f"MessageTimeout={MESSAGE_TIMEOUT}", f"TCPTimeout={TCP_TIMEOUT}", f"KillWait={KILL_WAIT}",
        f"SchedulerParameters=bf_interval={SCHED_INTERVAL},sched_interval={SCHED_INTERVAL}",
        "InactiveLimit=0", "MinJobAge=600", "SlurmctldDebug=info", "SlurmdDebug=info",
        *(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} State=UNKNOWN" for n in nodes),
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    return "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"


def daemon_script(hostname: str, command: list[str]) -> str:
    """The shell line a daemon starts with inside its node: the node's host name (in the
    UTS namespace ``unshare --uts`` made), cgroup v1 hierarchies mounted over the fresh
    ``/sys`` that ``ip netns exec`` gave its mount namespace, then the daemon."""
    mounts = "; ".join(f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup "
                       f"/sys/fs/cgroup/{c}" for c in CGROUP_CONTROLLERS)
    return (f"hostname {hostname} && mount -t tmpfs none /sys/fs/cgroup && {mounts} && "
            f"exec {' '.join(command)}")


def missing_prerequisite() -> str | None:
    """One line naming what a Slurm cluster needs and this machine lacks, or None."""
    from ddpguide.cluster import netns  # the network cluster's own needs come first

    missing = netns.missing_prerequisite()
    if missing:
        return missing
    lacking = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if lacking:
        return (f"{', '.join(lacking)} not found: install Slurm and munge "
                "(apt-get install slurm-wlm munge)")
    if shutil.which("munged") is None or not os.path.exists("/etc/munge/munge.key"):
        return "munged or /etc/munge/munge.key not found: install munge (apt-get install munge)"
    return None
