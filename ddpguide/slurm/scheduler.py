"""A Slurm cluster, as a context manager: ``with up(Spec(nodes=2)) as slurm: ...``.

The chapter-15 cluster is made first (its record, namespaces and links), then
the cluster's folder and configuration, munge, the controller and the
``slurmd``s; :func:`up` yields once ``sinfo`` shows every node idle. Leaving the
block stops the daemons by their pid files and removes the folder, then the
network cluster. A killed driver's leftovers are removed by the next
:func:`up` or :func:`remove_dead`: the network cluster's own cleaning stops
every process inside its namespaces, and a Slurm folder without a live
cluster is removed after it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpguide.cluster import netns
from ddpguide.cluster import up as cluster_up
from ddpguide.cluster.cluster import Cluster, from_record
from ddpguide.cluster.processes import run_all
from ddpguide.cluster.spec import Node, Spec
from ddpguide.core.commands import write_atomically
from ddpguide.launch.ranks import RankEnd
from ddpguide.slurm import daemons
from ddpguide.slurm.config import (
    FOLDERS,
    PARTITION,
    SLURMD_TIMEOUT,
    Layout,
    cgroup_conf,
    layout,
    missing_prerequisite,
    slurm_conf,
)

HOLDER = "slurm"  # the network cluster's record names the Slurm driver as its holder
READY_TIMEOUT = 60.0


class MissingPrerequisite(RuntimeError):
    """Root, iproute2, Slurm or munge is missing: the message says what to install."""


@dataclass
class Slurm:
    """A running Slurm cluster: the network cluster under it and its folder."""

    cluster: Cluster
    layout: Layout
    cpus: int

    @property
    def run_id(self) -> str:
        return self.cluster.run_id

    @property
    def nodes(self) -> list[Node]:
        return self.cluster.nodes

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return daemons.client_env(self.layout, base)

    def argv(self, command: list[str]) -> list[str]:
        """``command`` as a user types it on node 0 (its namespace and host name)."""
        return self.cluster.prefix(self.nodes[0]) + command

    def run(self, command: list[str], timeout: float, *, cwd: str | Path | None = None,
            capture: bool = True, extra_env: dict[str, str] | None = None) -> RankEnd:
        """Run ``command`` (``sbatch``, ``srun``, ``squeue``, ...) on node 0, bounded in time."""
        [done] = run_all([self.argv(command)], timeout, env=[{**self.env(), **(extra_env or {})}],
                         cwd=cwd, capture=capture)
        return done

    def run_through(self, command: list[str], timeout: float) -> int | None:
        """Run ``command`` on node 0 with this process's own terminal: its exit status, or
        None when it was stopped (its whole process group) after ``timeout`` s."""
        with subprocess.Popen(self.argv(command), env=self.env(), start_new_session=True) as proc:
            try:
                return proc.wait(timeout)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5.0)
                return None

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` shows it."""
        return daemons.sinfo_states(self.cluster, self.layout)

    def wait_for_states(self, wanted: dict[str, str] | str, timeout: float) -> dict[str, str]:
        return daemons.wait_until(self.cluster, self.layout, wanted, timeout)

    def slurmd_pid(self, node: Node) -> int | None:
        return daemons.pid_of(self.layout.slurmd_pid(node), "slurmd")

    def lose_node(self, node: Node) -> None:
        """Lose ``node`` as a machine is lost: its link cut, its ``slurmd`` killed outright, and
        every other process on it."""
        self.cluster.set_link(node, up=False)
        pid = self.slurmd_pid(node)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            netns.wait_for_exit([pid], 5.0)
        netns.kill_inside(node.netns, grace=0.0)  # the job's processes there die with the machine

    def restore_node(self, node: Node) -> None:
        """Bring ``node`` back: its link up and a fresh ``slurmd`` (``ReturnToService=2``
        returns it to service once it registers)."""
        self.cluster.set_link(node, up=True)
        daemons.start(self.cluster, self.layout, node,
                      ["slurmd", "-f", str(self.layout.conf), "-N", node.name])

    def table(self) -> str:
        lines = [f"slurm on cluster {self.run_id}: controller slurmctld on {self.nodes[0].name} "
                 f"({self.nodes[0].address}), partition {PARTITION!r}, {self.cpus} CPUs a node, "
                 f"SlurmdTimeout={SLURMD_TIMEOUT}s",
                 f"configuration: {self.layout.conf}"]
        return "\n".join([self.cluster.table(), *lines])


def write_folder(slurm_layout: Layout, cluster: Cluster, cpus: int) -> None:
    slurm_layout.state.mkdir(parents=True)
    for node in cluster.nodes:
        slurm_layout.spool(node).mkdir()
    write_atomically(slurm_layout.conf, slurm_conf(cluster.run_id, cluster.nodes, cpus,
                                                   slurm_layout.folder))
    write_atomically(slurm_layout.folder / "cgroup.conf", cgroup_conf())


def make_folder(slurm_layout: Layout, cluster: Cluster, cpus: int) -> None:
    """The cluster's folder, then munge answering, both under the munge lock: a cluster
    removed meanwhile (:func:`daemons.stop_munge_if_last`) sees this folder and keeps munge."""
    with daemons.munge_lock():
        write_folder(slurm_layout, cluster, cpus)
        daemons.ensure_munge()


@contextlib.contextmanager
def up(spec: Spec, *, cpus: int = 2) -> Iterator[Slurm]:
    """A Slurm cluster on ``spec``'s nodes, each with ``cpus`` CPUs, for the ``with`` block.

    Raises :class:`MissingPrerequisite` (nothing made) without root, iproute2,
    Slurm or munge; what dead drivers left is removed first.
    """
    missing = missing_prerequisite()
    if missing:
        raise MissingPrerequisite(missing)
    remove_dead()
    try:
        with cluster_up(spec, holder=HOLDER) as cluster:
            slurm_layout = layout(cluster.run_id)
            try:
                make_folder(slurm_layout, cluster, cpus)
                daemons.start_all(cluster, slurm_layout)
                slurm = Slurm(cluster, slurm_layout, cpus)
                slurm.wait_for_states("idle", READY_TIMEOUT)
                yield slurm
            finally:
                daemons.stop_all(slurm_layout, cluster.nodes)
                shutil.rmtree(slurm_layout.folder, ignore_errors=True)
    finally:
        daemons.stop_munge_if_last()


def folders() -> list[str]:
    """The run ids of the Slurm folders on this machine."""
    return sorted(p.name for p in FOLDERS.glob("*")
                  if p.is_dir() and re.fullmatch(r"[0-9a-f]{5}", p.name)) if FOLDERS.is_dir() else []


def live() -> dict[str, Slurm]:
    """The Slurm clusters whose driver is alive, by run id."""
    out = {}
    for run_id, record in netns.read_records().items():
        if record.get("holder") == HOLDER and netns.driver_alive(record) and run_id in folders():
            cluster = from_record(record)
            conf = layout(run_id).conf.read_text() if layout(run_id).conf.exists() else ""
            cpus = re.search(r" CPUs=(\d+)", conf)
            out[run_id] = Slurm(cluster, layout(run_id), int(cpus.group(1)) if cpus else 0)
    return out


def remove_dead() -> list[str]:
    """Remove what dead drivers left: their network clusters (every process in them, daemons
    included), then the Slurm folders no live cluster owns; the run ids removed."""
    # Folders first, records second: a folder seen here was made after its cluster's record,
    # so a Slurm cluster being made now is never taken for a dead one.
    present = folders()
    alive = {k for k, r in netns.read_records().items() if netns.driver_alive(r)}
    dead = [run_id for run_id in present if run_id not in alive]
    for run_id in dead:  # daemons first: one still starting is not inside its namespace yet
        daemons.kill_naming(FOLDERS / run_id)
    removed = set(netns.remove_dead())
    for run_id in dead:
        shutil.rmtree(FOLDERS / run_id, ignore_errors=True)
        removed.add(run_id)
    daemons.stop_munge_if_last()
    return sorted(removed)
