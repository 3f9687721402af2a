"""Where a tensor of the simulated GPU machine (:mod:`ddpguide.core.gpusim`) lives: a tensor
"on" ``cuda:K`` stays on the CPU, tagged with K, and results take their inputs' device;
CUDA events as CPU clocks."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ddpguide.core import gpusim_state as sim
from ddpguide.core.collective_devices import FACTORIES


class Placement(TorchFunctionMode):
    """Keeps "cuda" tensors on the CPU, tagged with their device; follows the tags."""

    def __init__(self, state: sim.State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        state = self.state
        name = getattr(func, "__name__", "")
        if name == "__get__" and args and isinstance(args[0], torch.Tensor):
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            index = getattr(args[0], sim.TAG, None)
            spec = getattr(args[0], "_spec", None) if index is None else None  # a DTensor's, made by torch
            if spec is not None and getattr(spec.mesh._get_root_mesh(), "_gpusim_cuda", False):
                index = getattr(getattr(args[0], "_local_tensor", None), sim.TAG, None)
                index = state.current if index is None or index < 0 else index
            if (prop in ("device", "is_cuda") and index is not None and index >= 0
                    and (id(args[0]) in state.told_cuda or sim.caller_outside_torch())):
                return torch.device("cuda", index) if prop == "device" else True
            return func(*args, **kwargs)
        if name in sim.SYNCING:
            state.queued = False
        if name == "pin_memory":
            return args[0]
        target = sim.HOST if name == "cpu" else None
        if kwargs.get("device") is not None:
            target = sim.cuda_index(kwargs["device"], state)
            if target is not None:
                kwargs["device"] = "cpu"
            else:
                target = sim.HOST
        elif name in FACTORIES and getattr(func, "__module__", "") in ("torch", "torch._C._VariableFunctions"):
            target = sim.HOST
        if name == "cuda":
            index = args[1] if len(args) > 1 else kwargs.get("device")
            target = sim.cuda_index(index if index is not None else "cuda", state)
            out = args[0]
        else:
            if name == "to":
                moved = list(args[:1])
                for a in args[1:]:
                    if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                        k = sim.cuda_index(a, state)
                        target, a = (k, "cpu") if k is not None else (sim.HOST, a)
                    elif isinstance(a, torch.Tensor):
                        target = getattr(a, sim.TAG, None)
                    moved.append(a)
                args = tuple(moved)
            out = func(*args, **kwargs)
        if target is None:  # a result is where its inputs are (on the GPU if any input is)
            tags = [getattr(t, sim.TAG, None) for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)]
            target = max((k for k in tags if k is not None), default=None)
        elif target == sim.HOST and args and out is args[0] and getattr(args[0], sim.TAG, sim.HOST) >= 0:
            out = out.clone()  # the host copy of a GPU tensor is another tensor
        if target is not None:
            if name == "backward" and target >= 0:  # DDP's and FSDP's collectives run inside it
                state.queued = True
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    try:
                        setattr(tensor, sim.TAG, target)
                    except (AttributeError, RuntimeError):
                        pass
        return out


_GENERIC_STREAM, _GENERIC_EVENT = torch.Stream, torch.Event  # torch's own, before they are replaced


class Event(torch.Event):
    """``torch.cuda.Event`` on the CPU: records a time; ``synchronize`` ends the queue. A
    ``torch.Event`` underneath (a CPU one), so ``isinstance(e, torch.Event)`` holds."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Event:
        return super().__new__(cls, device="cpu")

    def __init__(self, enable_timing: bool = False, **_: Any):
        assert sim.STATE is not None
        self.t = 0.0
        self._device = torch.device("cuda", sim.STATE.current)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device

    def record(self, stream: Any = None) -> None:
        assert sim.STATE is not None
        sim.STATE.record("Event.record")
        sim.STATE.queued = False
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        assert sim.STATE is not None
        sim.STATE.queued = False

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return float(end.t - self.t) * 1000.0


class Stream(torch.Stream):
    """``torch.cuda.Stream`` on the CPU: one queue; waiting on it ends the queue. A
    ``torch.Stream`` underneath (a CPU one), so ``isinstance(s, torch.Stream)`` holds, as
    Dynamo and torchft ask; equal only to itself, as two CUDA streams are."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Stream:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None, *args: Any, **kwargs: Any):
        assert sim.STATE is not None
        index = sim.cuda_index(device, sim.STATE) if device is not None else None
        self._device = torch.device("cuda", sim.STATE.current if index is None else index)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device

    @property
    def device_type(self) -> str:  # type: ignore[override]
        return "cuda"

    @property
    def device_index(self) -> int:  # type: ignore[override]
        return int(self._device.index or 0)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"simulated Stream(device={self._device})"

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        assert sim.STATE is not None
        sim.STATE.record("Stream.synchronize")
        sim.STATE.queued = False

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:  # type: ignore[override]
        event = event or Event()
        event.record()
        return event

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _TorchsType(type):
    """``isinstance`` and ``issubclass`` as torch's own class (``torch_class``) answers them."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.torch_class)  # type: ignore[attr-defined]

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, cls.torch_class)  # type: ignore[attr-defined]


class GenericStream(metaclass=_TorchsType):
    """``torch.Stream(device)``: a simulated :class:`Stream` for ``cuda`` or the accelerator
    (no device), torch's own for another device."""

    torch_class = _GENERIC_STREAM

    def __new__(cls, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        if device is None or sim.cuda_index(device, sim.STATE) is not None:
            return Stream(device)
        return _GENERIC_STREAM(device, *args, **kwargs)


class GenericEvent(metaclass=_TorchsType):
    """``torch.Event(device)``, as torchft's DiLoCo makes one: a simulated :class:`Event` for
    ``cuda`` or the accelerator, torch's own for another device."""

    torch_class = _GENERIC_EVENT

    def __new__(cls, device: Any = None, **kwargs: Any) -> Any:
        assert sim.STATE is not None
        if device is None or sim.cuda_index(device, sim.STATE) is not None:
            return Event(enable_timing=bool(kwargs.get("enable_timing", False)))
        return _GENERIC_EVENT(device, **kwargs)
