"""A machine with GPUs, simulated on the CPU: ``DDPGUIDE_SIMULATE_GPUS=N``.

The GPU branch of a program (the device count, the choice of nccl, which tensor goes to
which device) never runs on a machine without GPUs. With ``DDPGUIDE_SIMULATE_GPUS=N`` in
the environment and :data:`SITE` on ``PYTHONPATH`` (its ``sitecustomize`` calls
:func:`install`, so processes started by ``spawn`` or ``torchrun`` inherit it), a Python
process sees ``N`` GPUs, or as many of them as ``CUDA_VISIBLE_DEVICES`` names:

* ``torch.cuda.is_available()`` and ``device_count()`` follow the simulated machine, so the
  program's own device and backend choice picks nccl and ``cuda:K``;
* a tensor made or moved with ``device="cuda:K"``, ``.to(...)`` or ``.cuda()`` stays on the
  CPU but is tagged with ``K`` (the program's own code sees ``t.device == cuda:K``), and
  results take their inputs' device;
* a process group asked for nccl runs gloo underneath, and every collective of
  ``torch.distributed`` and of its functional collectives called from outside torch on such
  a group refuses a host tensor as nccl does ("No backend type associated with device type
  cpu"), a tensor of a device other than the rank's, and two ranks of one job on one GPU
  ("Duplicate GPU detected"); ``DistributedDataParallel`` refuses a module left on the host;
* ``SyncBatchNorm`` runs on simulated GPUs (:mod:`ddpguide.core.gpusim_syncbn`), and a
  ``DataLoader`` with ``pin_memory=True`` leaves its batches as they are;
* ``torch.cuda.is_bf16_supported()`` is True, or False with ``DDPGUIDE_SIMULATE_GPU_BF16=0``
  (a GPU older than compute capability 8.0);
* CUDA-only calls (``synchronize``, ``Event``, memory statistics and
  properties, ``set_device``; streams, one current stream per device, ``torch.Stream`` and
  ``torch.Event`` on the accelerator, ``torch.accelerator``'s device index) are stubs
  that are recorded; the simulation's own frames are never compiled by ``torch.compile``;
* a ``time.perf_counter()`` read by the program while GPU work is queued (a collective or
  a backward pass on the GPU, and no ``synchronize``, event or host copy since) is reported:
  on a GPU that timer measures the launches, not the work.

What it cannot see: kernels, the streams' real concurrency, torch's own internals on a GPU
(FSDP2's streams, DTensor's own code on a CUDA mesh, which runs on a CPU mesh here and says
"cuda" only to the code outside torch, compiled kernels),
and NCCL's own errors beyond the three above. Reports go to stderr, or as JSON lines to the
file ``DDPGUIDE_GPUSIM_LOG`` names.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from ddpguide.core import gpusim_nccl, gpusim_placement, gpusim_syncbn
from ddpguide.core import gpusim_state as sim
from ddpguide.core.gpusim_state import BF16_ENV, ENV, LOG_ENV, SITE, State, visible_gpus

__all__ = ["BF16_ENV", "ENV", "LOG_ENV", "SITE", "State", "environment", "install", "install_from_environ",
           "visible_gpus"]
_SELF = os.path.abspath(__file__)


def _stub(name: str, value: Any = None) -> Any:
    def stub(*args: Any, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        sim.STATE.record(name)
        return value(*args) if callable(value) else value
    return stub


def _set_device(device: Any) -> None:
    assert sim.STATE is not None
    sim.STATE.record("set_device")
    index = sim.cuda_index(device, sim.STATE)
    if index is not None:
        sim.STATE.current = index


def _current_stream(state: State, streams: dict[int, gpusim_placement.Stream]) -> Any:
    def current_stream(device: Any = None) -> gpusim_placement.Stream:
        index = sim.cuda_index(device if device is not None else "cuda", state)
        index = state.current if index is None else index
        return streams.setdefault(index, gpusim_placement.Stream(index))
    return current_stream


_MEMORY = 80 * 2**30  # a simulated GPU's memory, all of it free


def _properties(device: Any = None) -> Any:
    """``torch.cuda.get_device_properties``: a name, a UUID per physical GPU, the memory."""
    from types import SimpleNamespace

    assert sim.STATE is not None
    index = sim.cuda_index(device if device is not None else "cuda", sim.STATE) or 0
    visible = visible_gpus(sim.STATE.gpus)
    physical = visible[index] if index < len(visible) else index
    return SimpleNamespace(name="simulated GPU", uuid=f"GPU-simulated-{physical}",
                           total_memory=_MEMORY, major=9, minor=0, multi_processor_count=1)


def install(gpus: int) -> State:
    """Make this process see ``gpus`` simulated GPUs (see the module's docstring)."""
    if sim.STATE is not None:
        return sim.STATE
    sim.STATE = state = State(gpus)
    cuda = torch.cuda
    count = len(visible_gpus(gpus))
    cuda.is_available = lambda: count > 0
    cuda.device_count = lambda: count
    cuda.set_device = _set_device
    cuda.current_device = lambda: state.current
    cuda.synchronize = gpusim_nccl.synchronize
    setattr(cuda, "Event", gpusim_placement.Event)  # noqa: B010
    # one function per name: Dynamo keeps a handler per torch function, and refuses two for
    # one; a device's current (and default) stream is one object, as torchft's Manager asserts
    streams: dict[int, gpusim_placement.Stream] = {}
    for module, name in ((cuda, "current_stream"), (cuda, "default_stream"),
                         (torch.accelerator, "current_stream")):
        setattr(module, name, _current_stream(state, streams))
    setattr(cuda, "stream", lambda stream=None: stream if stream is not None else gpusim_placement.Stream())  # noqa: B010  # a context
    setattr(cuda, "Stream", gpusim_placement.Stream)  # noqa: B010  # type: ignore[assignment,misc]
    setattr(torch, "Stream", gpusim_placement.GenericStream)  # noqa: B010  # torch.Stream("cuda")
    setattr(torch, "Event", gpusim_placement.GenericEvent)  # noqa: B010  # torchft's DiLoCo
    torch.accelerator.current_device_index = lambda: state.current  # torchft's Manager asks
    torch.accelerator.set_device_index = _set_device
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, _stub(name, 0))
    cuda.reset_peak_memory_stats = _stub("reset_peak_memory_stats")
    cuda.empty_cache = _stub("empty_cache")
    bf16 = os.environ.get(BF16_ENV, "1").strip() != "0"  # 0: a GPU older than Ampere
    cuda.is_bf16_supported = lambda *a, **k: bf16
    cuda.get_device_name = lambda *a: "simulated GPU"
    cuda.get_device_properties = _properties
    cuda.mem_get_info = lambda *a: (_MEMORY, _MEMORY)
    cuda.nccl.version = lambda: (2, 0, 0)
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)  # fork_rng's
    cuda.set_rng_state = lambda *a, **k: None
    cuda.is_current_stream_capturing = lambda: False  # Dynamo asks before it traces a frame
    torch.load = _load(torch.load)
    # a DataLoader pins in a thread of its own, where the placement mode (thread-local) is not
    # entered; pinned memory is a host copy, so the batch stays as it is
    import torch.utils.data._utils.pin_memory as pinning
    pinning.pin_memory = _stub("pin_memory", lambda data, device=None: data)
    time.perf_counter = gpusim_nccl.timer(time.perf_counter)
    gpusim_nccl.patch_dist()
    gpusim_syncbn.install()
    gpusim_placement.Placement(state).__enter__()  # type: ignore[no-untyped-call]
    _hide_from_dynamo()
    return state


def _codes(value: Any, seen: set[int]) -> Any:
    """The code objects of a function, of a class's methods and properties, and nested ones."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, type):
        for item in vars(value).values():
            yield from _codes(item, seen)
    elif isinstance(value, property):
        yield from _codes(value.fget, seen)
    elif isinstance(value, (staticmethod, classmethod)):
        yield from _codes(value.__func__, seen)
    elif hasattr(value, "__code__"):
        yield from _codes(value.__code__, seen)
    elif isinstance(value, type(_codes.__code__)):
        yield value
        for const in value.co_consts:
            yield from _codes(const, seen)


def _hide_from_dynamo() -> None:
    """Dynamo compiles every Python frame outside torch that runs under ``torch.compile``, so
    the simulation's own (its torch-function mode's ``__torch_function__``, entered by each
    torch call of an eager DDP or nn.Sequential, its stubs and streams) would become graphs
    that a GPU never compiles. Their frames are skipped (each still inlined where Dynamo
    traces the caller); the flag is torch's C one, so Dynamo itself is not imported here."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    from ddpguide.core import collective_devices
    seen: set[int] = set()
    for module in (sys.modules[__name__], gpusim_placement, gpusim_nccl, gpusim_syncbn, sim,
                   collective_devices):
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) == module.__name__:
                for code in _codes(value, seen):
                    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def install_from_environ() -> State | None:
    """:func:`install` when ``DDPGUIDE_SIMULATE_GPUS`` is set to a count."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        sys.stderr.write(f"{ENV}={value!r} is not a GPU count\n")
        raise SystemExit(2)
    return install(int(value))


def environment(gpus: int, log: str | os.PathLike[str] | None = None,
                environ: Any = None) -> dict[str, str]:
    """``environ`` (default: this process's) with ``gpus`` simulated GPUs for every process
    started with it: :data:`SITE` and the package first on ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(_SELF)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, root, env.get("PYTHONPATH")) if p)
    env[ENV] = str(gpus)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if log is not None:
        env[LOG_ENV] = os.fspath(log)
    return env


def _load(original: Any) -> Any:
    """``torch.load(..., map_location="cuda:K")``: loaded on the CPU, every tensor tagged K."""
    import functools

    from torch.utils._pytree import tree_leaves

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        location = kwargs.get("map_location")
        index = sim.cuda_index(location, sim.STATE) if isinstance(location, (str, torch.device)) else None
        if index is None:
            return original(*args, **kwargs)
        out = original(*args, **{**kwargs, "map_location": "cpu"})
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                setattr(tensor, sim.TAG, index)
        return out
    return load

