"""Device meshes for every chapter: one place builds them, with the default group's timeout.

``init_device_mesh`` makes one process group per mesh dimension. Without
options those groups get c10d's default timeout (in torch 2.14.1,
``torch/distributed/constants.py``: 30 minutes for gloo, 10 for nccl), not the
one the job chose (:mod:`ddpguide.core.timeouts`), and a bug in a sub-group
would hang that long. :func:`device_mesh` passes every dimension the world
group's own timeout.

Reading that timeout needs private torch names. They are all in one function,
:func:`subgroup_backends`, which warns (``RuntimeWarning`` naming the missing
name) instead of failing silently when a torch release renames one.
"""

from __future__ import annotations

import datetime
import math
import warnings
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ddpguide.core.runtime import worker_device


def mesh_device_type() -> str:
    """The mesh device type of this process group: ``cuda`` under nccl, ``cpu`` under gloo."""
    return worker_device().type


def mesh_device(mesh: DeviceMesh | None = None) -> torch.device:
    """The device this rank's pieces of ``mesh`` live on: its own GPU for a cuda mesh (and,
    without a mesh, under nccl), else the CPU."""
    device = worker_device()
    return device if mesh is None or mesh.device_type == device.type else torch.device(mesh.device_type)


def subgroup_backends(ndim: int, group: Any = None, backend: str | None = None,
                      device_type: str | None = None) -> tuple[tuple[str, Any], ...] | None:
    """``backend_override`` for a mesh of ``ndim`` dimensions: each group gets ``group``'s timeout.

    ``group`` is the default (world) group unless given; ``backend`` and
    ``device_type`` are its own unless given. Returns None, with a
    ``RuntimeWarning`` naming what is missing, when torch's private names are
    gone: the sub-groups then fall back to c10d's default timeout.

    The private torch names it reads (torch 2.14.1): ``ProcessGroup._get_backend(device)``,
    ``Backend.Options._timeout`` (read from the world group's backend, and set on
    ``ProcessGroupNCCL.Options``, whose constructor takes no timeout).
    """
    group = dist.group.WORLD if group is None else group
    backend = backend or dist.get_backend()
    device_type = device_type or mesh_device_type()
    try:
        timeout: datetime.timedelta = group._get_backend(torch.device(device_type)).options._timeout
        options: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
        else:
            # at run time this is Backend.Options(backend, timeout); the stub lists no constructor
            options = dist.ProcessGroupGloo.Options(backend, timeout)  # type: ignore[call-arg]
    except AttributeError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        warnings.warn(f"torch {torch.__version__} has no {missing!r} (private API this package "
                      "reads the world group's timeout with): the mesh's sub-groups fall back to "
                      "c10d's default timeout (30 min for gloo, 10 for nccl)", RuntimeWarning,
                      stacklevel=2)
        return None
    return tuple((backend, options) for _ in range(ndim))


def device_mesh(mesh_shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """A row-major mesh of ranks ``0..prod(shape)-1`` (``init_device_mesh``), with timeouts.

    The device type is the worker's (never hard-coded) and each mesh
    dimension's process group gets the default group's timeout. Raises
    ``ValueError`` without a process group, or when the mesh needs more ranks
    than the world has.
    """
    if not dist.is_initialized():
        raise ValueError("no process group: run inside ddpguide.launch.spawn or torchrun "
                         "(a mesh names ranks of a running job)")
    world = dist.get_world_size()
    mesh_shape = tuple(int(s) for s in mesh_shape)
    needed = math.prod(mesh_shape)
    if needed > world:
        raise ValueError(f"mesh {mesh_shape} needs {needed} ranks but the world has only {world} "
                         f"(WORLD_SIZE={world})")
    # A 1-D mesh of the whole world reuses the world group, which has the timeout already.
    override = None if mesh_shape == (world,) else subgroup_backends(len(mesh_shape))
    return init_device_mesh(
        mesh_device_type(), mesh_shape,
        mesh_dim_names=tuple(names) if names else None,
        backend_override=dict(enumerate(override)) if override else None,
    )
