"""The daemons' environment and pid files, without starting a daemon."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpguide.slurm import daemons
from ddpguide.slurm.config import Layout, daemon_script


def test_a_task_on_another_node_inherits_no_interface_of_node0():
    base = {"PATH": "/usr/bin", "GLOO_SOCKET_IFNAME": "ddpgabcde-n0", "NCCL_SOCKET_IFNAME": "x",
            "DDPGUIDE_NODE_RANK": "0", "SLURM_JOB_ID": "7", "HOME": "/root"}
    env = daemons.client_env(Layout(Path("/run/ddpguide-slurm/abcde")), base)
    assert env == {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin", "HOME": "/root",
                   "SLURM_CONF": "/run/ddpguide-slurm/abcde/slurm.conf", "OMP_NUM_THREADS": "1"}


def test_a_job_sees_the_simulated_gpu_machine_of_its_submitter():
    from ddpguide.core import gpusim_state

    kept = {gpusim_state.ENV: "2", gpusim_state.BF16_ENV: "0", gpusim_state.LOG_ENV: "/tmp/log"}
    env = daemons.client_env(Layout(Path("/run/ddpguide-slurm/abcde")), {**kept, "DDPGUIDE_NODE_RANK": "1"})
    assert {k: v for k, v in env.items() if k.startswith("DDPGUIDE_")} == kept


def test_a_pid_file_counts_only_while_its_process_is_that_daemon(tmp_path):
    pid_file = tmp_path / "slurmd.pid"
    pid_file.write_text(f"{os.getpid()}\n")  # this process: alive, but not a slurmd
    assert daemons.pid_of(pid_file, "slurmd") is None
    assert daemons.pid_of(pid_file, Path("/proc/self/comm").read_text().strip()) == os.getpid()
    assert daemons.pid_of(tmp_path / "missing.pid", "slurmd") is None


def test_the_daemon_sets_its_host_name_and_mounts_cgroups_before_it_starts():
    line = daemon_script("node1", ["slurmd", "-N", "node1"])
    assert line.startswith("hostname node1 && mount -t tmpfs none /sys/fs/cgroup && ")
    assert line.endswith("&& exec slurmd -N node1")
    assert "mount -t cgroup -o freezer cgroup /sys/fs/cgroup/freezer" in line
