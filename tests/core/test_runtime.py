import builtins
import io
import os

import pytest
import torch

from ddpguide.core import runtime
from ddpguide.core.runtime import (
    DistEnv,
    DistEnvError,
    fair_thread_count,
    select_runtime,
)


def test_cpu_machine_gets_gloo_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    runtime = select_runtime(2, environ={})
    assert (runtime.backend, runtime.device_type) == ("gloo", "cpu")
    assert runtime.device(1) == torch.device("cpu")


def test_environment_overrides_and_arguments():
    assert select_runtime(1, environ={"DDPGUIDE_BACKEND": "gloo"}).backend == "gloo"
    runtime = select_runtime(1, backend="GLOO", environ={"DDPGUIDE_BACKEND": "nccl"})
    assert runtime.backend == "gloo" and runtime.device_type == "cpu"


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": "mpi"}, "unknown backend 'mpi': choose one of gloo, nccl"),
    ({"device_type": "tpu"}, "unknown device 'tpu': choose one of cpu, cuda"),
    ({"backend": "nccl", "device_type": "cpu"}, "backend 'nccl' needs device 'cuda'; use 'gloo' on CPU"),
])
def test_bad_choices_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as info:
        select_runtime(1, environ={}, **kwargs)
    assert str(info.value) == message


def test_cuda_without_gpu_is_rejected():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no GPU is visible"):
        select_runtime(1, device_type="cuda", environ={})


def test_fair_threads():
    assert fair_thread_count(2, cpu_count=2) == 1
    assert fair_thread_count(1, cpu_count=8) == 8
    assert fair_thread_count(16, cpu_count=2) == 1


TORCHRUN_NODE1 = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def test_env_is_read_into_one_value():
    env = DistEnv.from_environ(TORCHRUN_NODE1)
    assert env == DistEnv(3, 1, 4, 2, 1, "10.0.0.1", 29400)
    assert not env.is_main
    assert DistEnv.from_environ(env.as_environ()) == env


def test_env_defaults_for_one_node():
    env = DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2"})
    assert (env.local_rank, env.local_world_size, env.group_rank) == (1, 2, 0)


@pytest.mark.parametrize("change, message", [
    ({"RANK": None}, "missing environment variable RANK"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "-1"}, "RANK='-1' must be >= 0"),
    ({"RANK": "4"}, "RANK=4 must be smaller than WORLD_SIZE=4"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be smaller than LOCAL_WORLD_SIZE=2"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port (1-65535)"),
    ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 must not exceed WORLD_SIZE=4"),
])
def test_bad_env_values_name_the_variable(change, message):
    environ = dict(TORCHRUN_NODE1)
    for key, value in change.items():
        if value is None:
            environ.pop(key)
        else:
            environ[key] = value
    with pytest.raises(DistEnvError) as info:
        DistEnv.from_environ(environ)
    assert str(info.value).startswith(message)



def _simulate_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_one_gpu_per_rank_through_cuda_visible_devices_uses_that_gpu(monkeypatch):
    # srun --gpus-per-task=1: 8 ranks on the node, each sees only its own GPU.
    _simulate_gpus(monkeypatch, 1)
    worker = {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "5"}
    runtime = select_runtime(8, environ=worker)
    assert (runtime.backend, runtime.device_type) == ("nccl", "cuda")
    assert runtime.device(5) == torch.device("cuda", 0)


@pytest.mark.parametrize("gpus, environ", [
    (1, {"LOCAL_RANK": "1"}),  # one GPU for the whole machine, no per-rank binding
    (1, {"CUDA_VISIBLE_DEVICES": "0"}),  # not a launched worker (a notebook about to spawn 2)
    (2, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}),  # two GPUs for four ranks
])
def test_ranks_that_would_share_a_gpu_run_on_cpu(monkeypatch, gpus, environ):
    _simulate_gpus(monkeypatch, gpus)
    runtime = select_runtime(4 if gpus == 2 else 2, environ=environ)
    assert (runtime.backend, runtime.device_type) == ("gloo", "cpu")


def test_one_gpu_per_rank_on_a_machine_with_enough_gpus(monkeypatch):
    _simulate_gpus(monkeypatch, 4)
    runtime = select_runtime(4, environ={"LOCAL_RANK": "3"})
    assert (runtime.backend, runtime.device(3)) == ("nccl", torch.device("cuda", 3))


def test_nccl_with_fewer_gpus_than_ranks_is_refused_before_anything_starts(monkeypatch):
    # A 4-rank chapter on a 2-GPU machine with DDPGUIDE_BACKEND=nccl: nccl would refuse two
    # ranks on one GPU (or hang); the runtime says so at once.
    _simulate_gpus(monkeypatch, 2)
    with pytest.raises(ValueError) as info:
        select_runtime(4, environ={"DDPGUIDE_BACKEND": "nccl", "DDPGUIDE_DEVICE": "cuda"})
    assert str(info.value) == ("backend 'nccl' needs one GPU per rank: 4 ranks on this machine, "
                               "2 GPU(s) visible (use gloo, or fewer ranks)")
    assert select_runtime(2, environ={"DDPGUIDE_BACKEND": "nccl"}).backend == "nccl"
    # gloo may share a GPU between ranks (gpu-check's "all ranks on cuda")
    assert select_runtime(4, environ={"DDPGUIDE_BACKEND": "gloo", "DDPGUIDE_DEVICE": "cuda"}).device(3) == \
        torch.device("cuda", 1)


#: the programs that carry the rule of ``ddpguide.core.threads`` themselves
THREAD_PROGRAMS = ("ddp_torchrun.py", "ddp_spawn.py", "amp_ddp.py", "ring_allreduce.py")


@pytest.fixture
def cpus(monkeypatch):
    """Set the CPUs this process may use (its affinity, as taskset or Slurm would; a cgroup
    quota ``quota``/``period`` CPUs, as a container's --cpus, or none)."""
    real_open = builtins.open

    def allow(count: int, quota: str | None = None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)))

        def cgroup_open(path, *args, **kwargs):
            if str(path) == "/sys/fs/cgroup/cpu.max":
                if quota is None:
                    raise FileNotFoundError(path)
                return io.StringIO(quota)
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", cgroup_open)
    return allow


def test_the_cpus_counted_are_the_processs_not_the_hosts(cpus):
    cpus(1)
    assert runtime.usable_cpus() == 1
    assert runtime.fair_thread_count(1) == 1
    cpus(64, "max 100000")
    assert runtime.usable_cpus() == 64
    cpus(64, "250000 100000")  # --cpus=2.5
    assert runtime.usable_cpus() == 3


@pytest.mark.parametrize("environ,local,share", [
    ({}, 4, 8), ({"OMP_NUM_THREADS": "3"}, 4, 3),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, 4, 8),  # torchrun's own default
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, 1, 1),  # torchrun sets none for 1
    ({"OMP_NUM_THREADS": "0"}, 2, 16), ({"OMP_NUM_THREADS": "many"}, 40, 1)])
def test_one_rule_for_threads_per_rank_in_the_package_and_every_program(cpus, monkeypatch, environ, local, share):
    from ddpguide.launch import programs

    for name in ("OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    loaded = [programs.load(program) for program in THREAD_PROGRAMS]
    for allowed in ((32, None), (64, "3200000 100000")):  # 32 CPUs by affinity, by a quota
        cpus(*allowed)
        assert runtime.threads_per_rank(local) == share
        for program, module in zip(THREAD_PROGRAMS, loaded):
            assert module.threads_per_rank(local) == share, program
