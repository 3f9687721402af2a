"""Backend and device choice, and the distributed environment as one small value.

This is the one place in the package that decides between nccl on GPUs and gloo
on CPUs. Chapters and workers ask :func:`select_runtime` and never hard-code a
device string.

Environment overrides:

``DDPGUIDE_BACKEND``
    ``gloo`` or ``nccl``; forces the process-group backend.
``DDPGUIDE_DEVICE``
    ``cpu`` or ``cuda``; forces the device type.

GPUs are used when each rank on this machine gets its own: either the machine
shows at least ``LOCAL_WORLD_SIZE`` GPUs (rank ``LOCAL_RANK`` takes GPU
``LOCAL_RANK``), or the launcher left this worker exactly one
(``CUDA_VISIBLE_DEVICES`` naming one device, as ``srun --gpus-per-task=1`` and
many Kubernetes set-ups do; the rank takes ``cuda:0``, which is that GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from ddpguide.core.threads import fair_thread_count as fair_thread_count  # the package imports them here
from ddpguide.core.threads import limit_threads as limit_threads
from ddpguide.core.threads import threads_per_rank as threads_per_rank
from ddpguide.core.threads import usable_cpus as usable_cpus

BACKENDS = ("gloo", "nccl")
#: The variables torchrun gives each worker, in the order the book shows them.
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)
DEVICE_TYPES = ("cpu", "cuda")
#: the backend of a spawn that measures the CPU (its bytes, its cores) on any machine: its
#: tensors stay on the host, which an nccl group would refuse
CPU_BACKEND = "gloo"


class DistEnvError(ValueError):
    """A distributed environment variable is missing or malformed."""


@dataclass(frozen=True)
class Runtime:
    """Which backend the process group uses and where tensors live."""

    backend: str
    device_type: str

    def device(self, local_rank: int = 0) -> torch.device:
        """The device of the worker with this local rank (one GPU per rank).

        ``cuda:LOCAL_RANK`` among the GPUs this process sees; ``cuda:0`` when it
        sees one (the GPU its launcher left it).
        """
        if self.device_type == "cuda":
            return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")


def listed_cuda_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` names, or None when it is not set."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def one_gpu_per_rank(gpus: int, local_world_size: int, environ: Mapping[str, str]) -> bool:
    """Whether every rank on this machine has a GPU of its own.

    True when ``gpus`` (what ``torch.cuda.device_count()`` says in this process)
    covers every local rank, or when this is a launched worker whose
    ``CUDA_VISIBLE_DEVICES`` leaves it exactly the one GPU it sees (``srun
    --gpus-per-task=1``), unless it is a torchrun worker that shares it (:func:`shares_a_gpu`).
    """
    if gpus >= local_world_size:
        return True
    listed = listed_cuda_devices(environ)
    return (gpus == 1 and "LOCAL_RANK" in environ and listed is not None and len(listed) == 1
            and not shares_a_gpu(gpus, local_world_size, environ))


def shares_a_gpu(gpus: int, local_world_size: int, environ: Mapping[str, str]) -> bool:
    """Whether this torchrun worker sees one GPU that local rank 0 takes too.

    In its default mode torchrun passes its own ``CUDA_VISIBLE_DEVICES`` to every worker
    unchanged (``local_elastic_agent.py``, "don't override"), so one listed GPU is every
    worker's; with ``--virtual-local-rank`` each worker gets its own and ``LOCAL_RANK`` 0.
    """
    listed = listed_cuda_devices(environ)
    return (gpus == 1 and local_world_size > 1 and "TORCHELASTIC_RUN_ID" in environ
            and listed is not None and len(listed) == 1 and environ.get("LOCAL_RANK", "0") != "0")


def shared_gpu_refusal(gpus: int, local_world_size: int) -> str:
    """The line a worker that shares a GPU stops with (the book's programs print the same)."""
    return (f"{gpus} GPU visible to every one of {local_world_size} local ranks: nccl needs a GPU "
            "of its own for each rank (run one rank per GPU, give each its own with torchrun "
            "--virtual-local-rank, or hide it with CUDA_VISIBLE_DEVICES= to run on the CPU)")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    value = value.strip().lower()
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(choices)}")
    return value


def select_runtime(local_world_size: int = 1, backend: str | None = None, device_type: str | None = None,
                   environ: Mapping[str, str] | None = None) -> Runtime:
    """Choose backend and device for ``local_world_size`` workers on this machine.

    nccl with one GPU per rank when every rank has its own
    (:func:`one_gpu_per_rank`), otherwise gloo on CPU. Explicit arguments win over ``DDPGUIDE_BACKEND`` /
    ``DDPGUIDE_DEVICE``, which win over the automatic choice.
    """
    environ = os.environ if environ is None else environ
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    backend = backend or environ.get("DDPGUIDE_BACKEND") or None
    device_type = device_type or environ.get("DDPGUIDE_DEVICE") or None
    if backend is not None:
        backend = _check_choice("backend", backend, BACKENDS)
    if device_type is not None:
        device_type = _check_choice("device", device_type, DEVICE_TYPES)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough_gpus = one_gpu_per_rank(gpus, local_world_size, environ)
    if backend is None and device_type is None and shares_a_gpu(gpus, local_world_size, environ):
        # it cannot fall back to the CPU alone: local rank 0 has taken the GPU with nccl
        raise ValueError(shared_gpu_refusal(gpus, local_world_size))
    if device_type is None:
        if backend == "nccl":
            device_type = "cuda"
        elif backend == "gloo":
            device_type = "cpu"
        else:
            device_type = "cuda" if enough_gpus else "cpu"
    if backend is None:
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError("backend 'nccl' needs device 'cuda'; use 'gloo' on CPU")
    if device_type == "cuda" and gpus == 0:
        raise ValueError("device 'cuda' requested but no GPU is visible")
    if backend == "nccl" and not enough_gpus:
        # nccl refuses two ranks on one GPU; say so before any process starts.
        raise ValueError(f"backend 'nccl' needs one GPU per rank: {local_world_size} ranks on this "
                         f"machine, {gpus} GPU(s) visible (use gloo, or fewer ranks)")
    return Runtime(backend=backend, device_type=device_type)


_REQUIRED = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistEnv:
    """The variables a launcher (torchrun, or :mod:`ddpguide.launch.spawn`) gives a worker."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and saves."""
        return self.rank == 0

    @classmethod
    def single(cls) -> DistEnv:
        """The environment of a plain one-process run."""
        return cls()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read RANK, LOCAL_RANK, WORLD_SIZE, ... and check that they agree.

        RANK and WORLD_SIZE are required; the others default as for one node.
        Raises :class:`DistEnvError` naming the variable and its value.
        """
        environ = os.environ if environ is None else environ
        missing = [name for name in _REQUIRED if name not in environ]
        if missing:
            raise DistEnvError(
                f"missing environment variable {missing[0]}: start the script with torchrun, "
                "or use ddpguide.launch.spawn"
            )

        def integer(name: str, default: int | None, minimum: int) -> int:
            raw = environ.get(name)
            if raw is None:
                assert default is not None
                return default
            try:
                value = int(raw.strip())
            except ValueError:
                raise DistEnvError(f"{name}={raw!r} is not an integer") from None
            if value < minimum:
                raise DistEnvError(f"{name}={raw!r} must be >= {minimum}")
            return value

        world_size = integer("WORLD_SIZE", None, 1)
        rank = integer("RANK", None, 0)
        local_world_size = integer("LOCAL_WORLD_SIZE", world_size, 1)
        local_rank = integer("LOCAL_RANK", rank % local_world_size, 0)
        group_rank = integer("GROUP_RANK", rank // local_world_size, 0)
        master_port = integer("MASTER_PORT", 29500, 1)
        if rank >= world_size:
            raise DistEnvError(f"RANK={rank} must be smaller than WORLD_SIZE={world_size}")
        if local_rank >= local_world_size:
            raise DistEnvError(
                f"LOCAL_RANK={local_rank} must be smaller than LOCAL_WORLD_SIZE={local_world_size}"
            )
        if local_world_size > world_size:
            raise DistEnvError(
                f"LOCAL_WORLD_SIZE={local_world_size} must not exceed WORLD_SIZE={world_size}"
            )
        if master_port > 65535:
            raise DistEnvError(f"MASTER_PORT={master_port} is not a TCP port (1-65535)")
        master_addr = environ.get("MASTER_ADDR", "127.0.0.1").strip()
        if not master_addr:
            raise DistEnvError("MASTER_ADDR is empty")
        return cls(rank, local_rank, world_size, local_world_size, group_rank, master_addr, master_port)

    def as_environ(self) -> dict[str, str]:
        """The same values as environment variables (what a launcher exports)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def launcher_environment(rank: int, nproc: int, port: int, *, addr: str = "localhost",
                         run_id: str | None = None, error_file: str | None = None) -> dict[str, str]:
    """What a launcher gives local rank ``rank`` of ``nproc`` on one machine: torchrun's
    worker variables (:data:`LAUNCHER_VARIABLES` but ``OMP_NUM_THREADS``); the
    ``TORCHELASTIC_*`` ones only for a run of torch's agent (``run_id``)."""
    n = str(nproc)
    env = {**DistEnv(rank, rank, nproc, nproc, 0, addr, port).as_environ(),
           "ROLE_RANK": str(rank), "ROLE_NAME": "default", "GROUP_WORLD_SIZE": "1",
           "ROLE_WORLD_SIZE": n}
    if run_id is not None:
        env.update({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                    "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")})
        if error_file is not None:
            env["TORCHELASTIC_ERROR_FILE"] = error_file
    return env


def worker_device() -> torch.device:
    """Inside a worker with a process group: where this rank's tensors live.

    Its own GPU (``LOCAL_RANK``) when the process group runs nccl, else the CPU. Where no
    launcher set the variables (a group started from a file store), the rank and the world
    come from the group, and the local rank from ``LOCAL_RANK`` where it is set.
    """
    import torch.distributed as dist

    backend = dist.get_backend()
    try:
        env = DistEnv.from_environ()
        local_rank, local_world_size = env.local_rank, env.local_world_size
    except DistEnvError:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return select_runtime(local_world_size, backend=backend).device(local_rank)
