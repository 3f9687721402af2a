"""The state of the simulated GPU machine (:mod:`ddpguide.core.gpusim`) in this process,
and what its parts share: the device tag, the reports, where a call comes from."""

from __future__ import annotations

import json
import os
import sys
import weakref
from typing import Any

import torch

ENV = "DDPGUIDE_SIMULATE_GPUS"
LOG_ENV = "DDPGUIDE_GPUSIM_LOG"
BF16_ENV = "DDPGUIDE_SIMULATE_GPU_BF16"  # "0": the simulated GPUs have no bfloat16
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpusim_site")
TAG = "_gpusim_device"  # the attribute a tensor "on" cuda:K carries: K (HOST: made on the host)
HOST = -1
HOST_REFUSAL = "No backend type associated with device type cpu"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__))
#: the frames a caller is looked for beyond: this simulation's and the collectives' wrapper
_OURS = (os.path.join(_HERE, "gpusim"), os.path.join(_HERE, "collective_devices.py"))
#: calls that wait for the GPU on a real one (a copy to the host, .item())
SYNCING = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"})

class State:
    """What the simulation saw in this process."""

    def __init__(self, gpus: int):
        self.gpus = gpus
        self.current = 0
        self.rank_device: int | None = None  # the device of this rank's first nccl collective
        # weak: a group destroyed by the program must not live on here, or its gloo threads
        # are torn down only at interpreter exit, where they abort the process (SIGABRT)
        self.nccl_groups: weakref.WeakSet[Any] = weakref.WeakSet()
        self.queued = False  # GPU work launched since the last synchronisation
        self.in_flight: set[Any] = set()  # nccl works launched asynchronously, not yet waited
        self.batch_of: dict[Any, tuple[Any, ...]] = {}  # a work: the works of its batch
        self.calls: dict[str, int] = {}
        self.reported: set[str] = set()
        self.told_cuda: set[int] = set()  # ids of tensors whose device torch's code reads as cuda:K

    def record(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1


STATE: State | None = None

def visible_gpus(simulated: int, environ: Any = None) -> list[int]:
    """The physical indices of the simulated GPUs this process sees (``CUDA_VISIBLE_DEVICES``)."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(simulated))
    out = []
    for item in (i.strip() for i in listed.split(",")):
        if not item.isdigit() or int(item) >= simulated:
            break  # CUDA stops at the first entry it cannot use
        out.append(int(item))
    return out


def report(kind: str, message: str) -> None:
    """One finding, to ``DDPGUIDE_GPUSIM_LOG`` (JSON lines) or stderr."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "message": message, "pid": os.getpid()}) + "\n")
    else:
        sys.stderr.write(f"gpusim: {message}\n")


def caller_outside_torch(depth: int = 2) -> str | None:
    """``file:line`` of the nearest frame outside torch and this module, if it is not torch's."""
    frame: Any = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCH) or path.startswith(_OURS) or path.startswith("<frozen"):
            if path.startswith(_TORCH):
                return None
            frame = frame.f_back
            continue
        return f"{path}:{frame.f_lineno}"
    return None


def cuda_index(device: Any, state: State) -> int | None:
    """K when ``device`` names ``cuda[:K]``, else None."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type == "cuda":
            return state.current if d.index is None else d.index
    return None
