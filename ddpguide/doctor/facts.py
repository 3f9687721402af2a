"""What one rank knows about itself before it talks to anyone.

The launcher's variables are read leniently here (the doctor reports what is
wrong instead of stopping at the first error), the versions and the GPUs are
looked up, and the whole is one JSON-ready dict per rank.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch

from ddpguide.core.runtime import LAUNCHER_VARIABLES, Runtime, listed_cuda_devices, one_gpu_per_rank
from ddpguide.doctor import FAKE_GPUS_VARIABLE, LOCAL_LAUNCH_VARIABLE
from ddpguide.doctor.gpu import fake_state, gpu_health
from ddpguide.doctor.storage import shm_bytes


@dataclass(frozen=True)
class Identity:
    """The launcher's answer to "who am I", enough to reach the others."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int
    agent_store: bool   # torchrun's agent hosts the store; otherwise rank 0 does


class IdentityError(ValueError):
    """A launcher variable this rank cannot work without is missing or invalid."""


def _integer(environ: Mapping[str, str], name: str, default: int | None) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise IdentityError(f"{name} is not set")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise IdentityError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise IdentityError(f"{name}={raw} is negative")
    return value


def read_identity(environ: Mapping[str, str]) -> Identity:
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are needed; LOCAL_* default as for one node.

    Raises :class:`IdentityError` for the problems that make the rank unable to
    take part (``RANK >= WORLD_SIZE``, no rendezvous address). A LOCAL_RANK out
    of range is not one of them: it is reported with the others' view.
    """
    world_size = _integer(environ, "WORLD_SIZE", None)
    rank = _integer(environ, "RANK", None)
    if world_size < 1:
        raise IdentityError(f"WORLD_SIZE={world_size} must be at least 1")
    if rank >= world_size:
        raise IdentityError(f"RANK={rank} is not smaller than WORLD_SIZE={world_size}")
    local_world_size = _integer(environ, "LOCAL_WORLD_SIZE", world_size) or 1
    local_rank = _integer(environ, "LOCAL_RANK", rank % local_world_size)
    group_rank = _integer(environ, "GROUP_RANK", rank // local_world_size)
    master_addr = environ.get("MASTER_ADDR", "").strip()
    if not master_addr:
        raise IdentityError("MASTER_ADDR is not set")
    master_port = _integer(environ, "MASTER_PORT", None)
    if not 1 <= master_port <= 65535:
        raise IdentityError(f"MASTER_PORT={master_port} is not a TCP port (1-65535)")
    # The same test torch's env:// rendezvous makes.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return Identity(rank, world_size, local_rank, local_world_size, group_rank,
                    master_addr, master_port, agent_store)


def launcher_name(environ: Mapping[str, str]) -> str:
    """Who started this process, as far as its environment tells."""
    if environ.get(LOCAL_LAUNCH_VARIABLE):
        return "ddpguide.doctor (local group)"
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if environ.get("SLURM_PROCID"):
        return "SLURM (srun)"
    return "by hand (environment variables)"


def gpu_inventory(environ: Mapping[str, str]) -> tuple[list[str], bool]:
    """The identities of the GPUs this process sees, and whether they are simulated.

    A real GPU is named by its UUID, so two ranks that see "GPU 0" through
    different ``CUDA_VISIBLE_DEVICES`` are told apart, and two that share one are not.
    """
    fake = environ.get(FAKE_GPUS_VARIABLE, "").strip()
    if fake:
        if not fake.isdigit():
            raise IdentityError(f"{FAKE_GPUS_VARIABLE}={fake!r} is not a whole number")
        count = int(fake)
        # Simulated GPUs are named after what CUDA_VISIBLE_DEVICES lists, so ranks bound to
        # different devices see different GPUs, as UUIDs would tell them apart.
        fake_state(environ)  # a malformed simulated state is reported here, before anything starts
        listed = listed_cuda_devices(environ) or []
        names = listed if len(listed) == count else [str(i) for i in range(count)]
        return [f"fake-gpu-{name}" for name in names], True
    if not torch.cuda.is_available():
        return [], False
    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        ids.append(str(getattr(props, "uuid", f"{props.name} #{index}")))
    return ids, False


def backend_versions() -> dict[str, Any]:
    """Versions that must agree across ranks (torch) or that explain a failure (nccl, CUDA)."""
    versions: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gloo": torch.distributed.is_gloo_available(),
        "nccl": None,
    }
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        versions["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return versions


#: environment variables that set nccl's behaviour (nccl's own, and ProcessGroupNCCL's)
NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def rank_facts(identity: Identity, runtime: Runtime, environ: Mapping[str, str],
               connect_ms: float) -> dict[str, Any]:
    """This rank's record: identity, host, launcher variables, versions, its device."""
    gpu_ids, simulated = gpu_inventory(environ)
    # The package's rule (select_runtime): GPUs only when every local rank has its own.
    gpu_index = None
    if gpu_ids and one_gpu_per_rank(len(gpu_ids), identity.local_world_size, environ):
        gpu_index = identity.local_rank if len(gpu_ids) >= identity.local_world_size else 0
    if runtime.device_type == "cuda":
        device = str(runtime.device(identity.local_rank))
        gpu_index = runtime.device(identity.local_rank).index if gpu_ids else gpu_index
    elif gpu_index is not None and simulated:
        device = f"cuda:{gpu_index} (fake)"  # the tensors stay on the CPU
    else:
        device = "cpu"
    return {
        **asdict(identity),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "launcher": launcher_name(environ),
        "variables": {name: environ.get(name) for name in LAUNCHER_VARIABLES if name in environ},
        # nccl's settings: a node started with other ones (another image, a stale export) can
        # choose other transports or protocols than its peers and hang or slow the job
        "nccl_variables": {k: v for k, v in sorted(environ.items()) if k.startswith(NCCL_PREFIXES)},
        "versions": backend_versions(),
        "backend": runtime.backend,
        "device": device,
        "gpus_visible": len(gpu_ids),
        "gpus_simulated": simulated,
        # The GPU this rank would use (None: the job runs on the CPU).
        "gpu_id": gpu_ids[gpu_index] if gpu_index is not None else None,
        # its free memory, the other processes on it, a matmul against the CPU (doctor.gpu)
        "gpu_health": None if device == "cpu" or gpu_index is None else gpu_health(
            gpu_ids[gpu_index], gpu_index, simulated, environ),
        "cpu_forced": environ.get("DDPGUIDE_DEVICE", "").strip().lower() == "cpu"
        or environ.get("DDPGUIDE_BACKEND", "").strip().lower() == "gloo",
        "connect_ms": round(connect_ms, 3),
        "shm_bytes": shm_bytes(),
    }
