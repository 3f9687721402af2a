"""nccl on the simulated GPU machine (:mod:`ddpguide.core.gpusim`): gloo underneath, and on
top the refusals of nccl (a host tensor, another device's, a GPU two ranks share), DDP's of
a module left on the host, DTensor's CUDA mesh as a CPU one, the timer report, and the
report of a ``torch.cuda.synchronize`` that would wait for NCCL's transfers."""

from __future__ import annotations

import functools
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from ddpguide.core import gpusim_state as sim
from ddpguide.core.collective_devices import COLLECTIVES, FUNCTIONAL, wrap_collectives


def _group_is_nccl(group: Any) -> bool:
    assert sim.STATE is not None
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    return group in sim.STATE.nccl_groups


def check_collective(name: str, group: Any, args: Any, kwargs: Any) -> None:
    """Refuse what nccl refuses: a host tensor, another device's, a GPU two ranks share."""
    state = sim.STATE
    assert state is not None
    if not _group_is_nccl(group):
        return
    for leaf in tree_leaves((args, kwargs)):
        tensor = getattr(leaf, "tensor", leaf)  # a P2POp carries its tensor
        if not isinstance(tensor, torch.Tensor):
            continue
        index = getattr(tensor, sim.TAG, None)
        if index is None:  # made by torch's own C++ (DDP's buckets, autograd's gradients)
            continue
        if index == sim.HOST:
            raise RuntimeError(f"{sim.HOST_REFUSAL} (simulated nccl: {name} was given a host tensor)")
        claim_device(index)
    state.queued = True


def claim_device(index: int) -> None:
    """This rank's device is the first one its collectives use; two ranks on one GPU refused."""
    state = sim.STATE
    assert state is not None
    if state.rank_device is None:
        physical = sim.visible_gpus(state.gpus)[index] if index < len(sim.visible_gpus(state.gpus)) else index
        store = dist.distributed_c10d._get_default_store()
        rank = str(dist.get_rank())
        # nccl compares host hashes (the host name among them) with the bus id: ranks of
        # hosts with different names (chapter 15's UTS namespaces) are not refused
        owner = store.compare_set(f"gpusim/gpu/{socket.gethostname()}/{physical}", "", rank).decode()
        if owner != rank:
            raise RuntimeError(f"Duplicate GPU detected : rank {rank} and rank {owner} both on "
                               f"CUDA device {physical} (simulated nccl)")
        state.rank_device = index
    elif index != state.rank_device:
        raise RuntimeError(f"Tensor found on device cuda:{index} but backend constrained to "
                           f"cuda:{state.rank_device} (simulated nccl)")


def _before(name: str, caller: str, args: Any, kwargs: Any) -> None:
    if sim.caller_outside_torch(3):
        group = kwargs.get("group")
        check_collective(name, group if isinstance(group, dist.ProcessGroup) else None, args, kwargs)


def _nccl_as_gloo(original: Any, *, returns_group: bool) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        backend = kwargs.get("backend", args[0] if args and isinstance(args[0], str) else None)
        nccl = isinstance(backend, str) and "nccl" in backend
        if nccl:
            if "backend" in kwargs:
                kwargs["backend"] = "gloo"
            else:
                args = ("gloo", *args[1:])
        out = original(*args, **kwargs)
        group = out if returns_group else dist.distributed_c10d._get_default_group()
        if nccl and isinstance(group, dist.ProcessGroup):  # not new_group's NON_GROUP_MEMBER
            sim.STATE.nccl_groups.add(group)
        return out
    return wrapper


def patch_dist() -> None:
    c10d = dist.distributed_c10d
    init = _nccl_as_gloo(c10d.init_process_group, returns_group=False)
    new = _nccl_as_gloo(c10d.new_group, returns_group=True)
    original_backend = c10d.get_backend

    def get_backend(group: Any = None) -> str:
        return "nccl" if _group_is_nccl(group) else original_backend(group)

    original_barrier = c10d.barrier

    @functools.wraps(original_barrier)
    def barrier(*args: Any, **kwargs: Any) -> Any:
        out = original_barrier(*args, **kwargs)
        if not kwargs.get("async_op"):
            # nccl's barrier blocks the CPU until its all-reduce is done, and that waits for
            # the work queued before it
            assert sim.STATE is not None
            sim.STATE.queued = False
        return out

    for module in (dist, c10d):
        module.barrier = barrier  # type: ignore[attr-defined]
        module.init_process_group = init  # type: ignore[attr-defined]
        module.new_group = new  # type: ignore[attr-defined]
        module.get_backend = get_backend  # type: ignore[attr-defined]
    wrap_collectives((dist, c10d), COLLECTIVES, "torch.distributed.", _before)
    _track_in_flight((dist, c10d))
    import torch.distributed._functional_collectives as funcol
    wrap_collectives((funcol,), FUNCTIONAL, "functional ", _before)
    _patch_ddp()
    _patch_mesh()


def _patch_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.__init__

    @functools.wraps(original)
    def init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        group = kwargs.get("process_group")
        if _group_is_nccl(group):
            for param in module.parameters():
                index = getattr(param, sim.TAG, sim.HOST)
                if index == sim.HOST:
                    raise RuntimeError(f"{sim.HOST_REFUSAL} (simulated nccl: DistributedDataParallel "
                                       "was given a module with parameters on the host)")
                claim_device(index)
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
            args = ()  # device_ids, output_device: a CPU module takes neither
        original(self, module, *args, **kwargs)

    DDP.__init__ = init  # type: ignore[method-assign]


def _patch_mesh() -> None:
    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.init_device_mesh

    @functools.wraps(original)
    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        sim.STATE.record("init_device_mesh(cuda)" if device_type == "cuda" else "init_device_mesh")
        mesh = original("cpu" if device_type == "cuda" else device_type, *args, **kwargs)
        if device_type == "cuda":  # its groups are nccl's on a GPU
            sim.STATE.nccl_groups.update(mesh.get_group(i) for i in range(mesh.ndim))
            setattr(mesh, "_gpusim_cuda", True)  # noqa: B010
        return mesh

    told: Any = device_mesh.DeviceMesh.device_type

    def device_type(self: Any) -> str:
        """A CUDA mesh, which is a CPU one here, says "cuda" to the code outside torch."""
        real: str = told.fget(self)
        if real == "cpu" and getattr(self._get_root_mesh(), "_gpusim_cuda", False) and sim.caller_outside_torch():
            return "cuda"
        return real

    device_mesh.DeviceMesh.device_type = property(device_type)  # type: ignore[assignment,method-assign]
    device_mesh.init_device_mesh = init_device_mesh
    dist.device_mesh.init_device_mesh = init_device_mesh


def timer(original: Any) -> Any:
    @functools.wraps(original)
    def read() -> float:
        state = sim.STATE
        if state is not None and state.queued:
            where = sim.caller_outside_torch()
            if where is not None and where not in state.reported:
                state.reported.add(where)
                sim.report("timer", f"{where}: the clock is read while GPU work is queued (no "
                       "torch.cuda.synchronize(), CUDA event or host copy since): on a GPU "
                       "this times the launches, not the work")
        return float(original())
    return read


ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})  # async whatever async_op says


def _track_in_flight(modules: tuple[Any, ...]) -> None:
    """Keep the works of nccl transfers launched asynchronously (by the program or by torch)
    until they are waited for: on a GPU they run on NCCL's own streams meanwhile."""
    state = sim.STATE
    assert state is not None
    for name in COLLECTIVES:
        original = getattr(modules[0], name)

        @functools.wraps(original)
        def tracked(*args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            out = __original(*args, **kwargs)
            if __name in ASYNC or kwargs.get("async_op"):
                ops = args[0] if __name == "batch_isend_irecv" and args else ()
                group = ops[0].group if ops else kwargs.get("group")
                if _group_is_nccl(group):
                    works = tuple(w for w in (out if isinstance(out, list) else [out]) if w is not None)
                    state.in_flight.update(works)
                    for work in works:  # nccl runs a batch as one group: one work for all
                        state.batch_of[work] = works
            return out

        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, tracked)
    wait = dist.Work.wait

    @functools.wraps(wait)
    def waited(self: Any, *args: Any, **kwargs: Any) -> Any:
        for work in state.batch_of.pop(self, (self,)):
            state.in_flight.discard(work)
            state.batch_of.pop(work, None)
        return wait(self, *args, **kwargs)

    dist.Work.wait = waited  # type: ignore[method-assign]


def synchronize(device: Any = None) -> None:
    """``torch.cuda.synchronize``: waits for every stream of the device, NCCL's included, so
    one called while a transfer is in flight (a receive its peer has not sent yet) is
    reported: a compute span that ends or starts at it counts the transfer."""
    state = sim.STATE
    assert state is not None
    state.record("synchronize")
    if state.in_flight:
        where = sim.caller_outside_torch()
        if where is not None and where not in state.reported:
            state.reported.add(where)
            sim.report("synchronize", f"{where}: torch.cuda.synchronize() while nccl transfers are "
                       "in flight (isend, irecv or async_op=True, not yet waited): on a GPU it also "
                       "waits for NCCL's streams, so a span it bounds counts the transfers; record "
                       "CUDA events on the compute stream instead")
    state.in_flight.clear()  # done, on a GPU, once synchronize returns
    state.batch_of.clear()
    state.queued = False
