"""The package's own workers on the simulated GPU machine (``ddpguide.core.gpusim``): each
spawn a chapter makes runs its GPU branch (nccl, one simulated GPU per rank), and a tensor
left on the host fails at its collective as it would on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpguide.core import gpusim

pytestmark = pytest.mark.multiprocess


def simulated(tmp_path, gpus: int, source: str, log=None) -> subprocess.CompletedProcess:
    body = "".join(f"    {line}\n" for line in source.splitlines())
    (tmp_path / "check.py").write_text(f"if __name__ == '__main__':  # spawn imports it again\n{body}")
    return subprocess.run([sys.executable, "check.py"], cwd=tmp_path, env=gpusim.environment(gpus, log),
                          capture_output=True, text=True, timeout=600)


def passes(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "No backend type associated" not in done.stderr


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_chapter_8_checks_run_on_the_ranks_devices(tmp_path, gpus):
    """N8.1: the 1-rank spawn picks nccl on any GPU machine, the 2-rank one on 2 or more."""
    done = simulated(tmp_path, gpus, (
        "from ddpguide.launch.spawn import spawn\nfrom ddpguide.sharding import checks\n"
        "from ddpguide.core.runtime import select_runtime\n"
        "assert select_runtime(1).backend == 'nccl'\n"
        "spawn(checks.run_parts, 1, ['memory'], echo=False, timeout=300)\n"
        "spawn(checks.run_parts, 2, ['collectives'], echo=False, timeout=300)\n"
        "print('ok')\n"))
    passes(done)


@pytest.mark.parametrize("gpus", [2, 8])
def test_chapter_11_and_12_workers_measure_the_cpu_on_a_gpu_machine(tmp_path, gpus):
    """N11.1: ring attention's memory sweep and the MoE traffic count give their collectives
    host tensors: they spawn gloo, whatever the machine."""
    done = simulated(tmp_path, gpus, (
        "from ddpguide.context import memory\nfrom ddpguide.experts import traffic\n"
        "print(memory.sweep([8], worlds=(2,)))\nprint(traffic.count(2))\n"))
    passes(done)


@pytest.mark.parametrize("gpus", [2])
def test_chapter_4s_two_loopback_nodes_never_share_a_gpu(tmp_path, gpus):
    """N4.1: both agents' workers took cuda:0: nccl's duplicate GPU at world size 2. With 2
    GPUs each node gets its own."""
    done = simulated(tmp_path, gpus, (
        "from ddpguide.elastic import program\n"
        "run = program.run_join(timeout=240)\n"
        "print([a.returncode for a in run.agents])\n"
        "assert [a.returncode for a in run.agents] == [0, 0], [a.output[-2000:] for a in run.agents]\n"))
    passes(done)
    assert "Duplicate GPU" not in done.stdout + done.stderr


def test_chapter_2s_bucket_timer_waits_for_the_all_reduces(tmp_path):
    """N2.1: the clock was read right after the all-reduces were queued (nccl at 2 GPUs)."""
    done = simulated(tmp_path, 2, (
        "from ddpguide.launch.spawn import spawn\nfrom ddpguide.ddp import by_hand\n"
        "from ddpguide.core.runtime import select_runtime\n"
        "assert select_runtime(2).backend == 'nccl'\n"
        "print(spawn(by_hand.bucketing_savings, 2, 4, 4, 1, echo=False, timeout=120))\n"),
        log=tmp_path / "gpusim.log")
    passes(done)
    assert not (tmp_path / "gpusim.log").exists(), (tmp_path / "gpusim.log").read_text()
