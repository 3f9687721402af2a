"""``python -m ddpguide.core.collective_devices PROGRAM [ARGS...]``: run a program and stop
it at the first collective that is given a tensor the program made on the host.

The rule "every tensor given to a collective lives on the rank's device" cannot be seen on
a machine without GPUs, where the rank's device is the CPU and nccl is never used. What can
be seen is where each tensor came from. A torch function mode (``TorchFunctionMode``, which
sees every torch call, ``t.to("cpu")`` included although it returns ``t`` unchanged) tags
the tensors the program's own files make without a device (``torch.tensor([...])``,
``torch.zeros(n)``, ``nn.Linear(...)``'s weights, ``t.cpu()``) as made on the host, with
the line that made them; a tensor put on a device (``device=``, ``.to(device)``,
``.cuda()``) is tagged as placed, and every other result takes the tags of its inputs
(placed if any input is: on a GPU, an operation on a GPU tensor runs there). Each
collective of ``torch.distributed`` and of its functional collectives then refuses a
host-made tensor: on nccl that tensor would be on the CPU, and a group with only a CUDA
backend answers "No backend type associated with device type cpu".

Only the collectives the program's own files call are checked: those torch calls inside
its own functions (``distribute_tensor`` moves a tensor to the mesh's device before it
scatters it, FSDP makes its buffers on the device) are torch's to get right, and a tensor
torch makes where the program asked for nothing (autograd's gradients) carries no tag.
So a model left on the CPU under DDP is not seen. The violation is one line on stderr,
exit status 3.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

PLACED = "placed"
TAG = "_collective_devices_tag"  # the attribute each followed tensor carries
EXIT_STATUS = 3
FACTORIES = frozenset({
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "normal", "from_numpy",
    "frombuffer", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
})
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "all_gather_coalesced",
)
FUNCTIONAL = (
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single",
    "all_gather_single_autograd", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_single", "reduce_scatter_single_autograd", "all_to_all_single",
    "all_to_all_single_autograd", "broadcast", "permute_tensor",
)
_TORCH = os.path.dirname(torch.__file__) + os.sep


class Provenance(TorchFunctionMode):
    """Tags each tensor the program's files make: the line that made it on the host, or
    PLACED; results take their inputs' tags."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = os.path.realpath(folder) + os.sep

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tag = self.tag_of(func, args, kwargs)
        if tag is not None:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    # an attribute, not a weak dictionary: torch.utils.swap_tensors (meta
                    # initialisation, to_empty) refuses a tensor that has a weak reference
                    with contextlib.suppress(AttributeError, RuntimeError):
                        setattr(tensor, TAG, tag)
        return out

    def tag_of(self, func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in FACTORIES and getattr(func, "__module__", "") in ("torch", "torch._C._VariableFunctions"):
            return PLACED if kwargs.get("device") is not None else self.made_here()
        if name.endswith("_like") and kwargs.get("device") is not None:
            return PLACED
        if name == "to" and (kwargs.get("device") is not None or any(
                isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:])):
            return PLACED
        if name == "cuda":
            return PLACED
        if name == "cpu":
            return self.made_here()
        tags = [getattr(t, TAG, None) for t in inputs]
        if PLACED in tags:
            return PLACED
        return next((tag for tag in tags if tag is not None), None)

    def made_here(self) -> str | None:
        """``file:line`` of the call when the nearest caller outside torch is the program's."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if not (path.startswith(_TORCH) or path == __file__):
                real = os.path.realpath(path)
                if real.startswith(self.folder):
                    return f"{os.path.relpath(real, self.folder)}:{frame.f_lineno}"
                return None
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def check(self, collective: str, args: Any, kwargs: Any) -> None:
        for leaf in tree_leaves((args, kwargs)):
            tensor = getattr(leaf, "tensor", leaf)  # a P2POp carries its tensor
            if not isinstance(tensor, torch.Tensor):
                continue
            tag = getattr(tensor, TAG, None)
            if tag is not None and tag != PLACED:
                sys.stderr.write(
                    f"collective device check: {collective} was given a tensor made on the host at "
                    f"{tag} (no device=, .to(device) or .cuda()): on nccl it would be on the CPU\n")
                sys.stderr.flush()
                os._exit(EXIT_STATUS)


def wrap_collectives(modules: tuple[Any, ...], names: tuple[str, ...], prefix: str,
                     before: Any) -> None:
    """Wrap each collective in every module that names it (``dist`` and ``distributed_c10d``
    alike: ``P2POp`` accepts only the ``isend`` its own module holds): ``before(name, caller,
    args, kwargs)`` sees each call first, ``caller`` the file that made it."""
    for name in names:
        original = getattr(modules[0], name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def guarded(*args: Any, __original: Any = original, __name: str = prefix + name,
                    **kwargs: Any) -> Any:
            before(__name, os.path.realpath(sys._getframe(1).f_code.co_filename), args, kwargs)
            return __original(*args, **kwargs)

        for module in modules:
            if getattr(module, name, None) is original:
                setattr(module, name, guarded)


def _guard(mode: Provenance, modules: tuple[Any, ...], names: tuple[str, ...], prefix: str) -> None:
    def before(name: str, caller: str, args: Any, kwargs: Any) -> None:
        if caller.startswith(mode.folder):  # called by the program's code, not inside torch
            mode.check(name, args, kwargs)

    wrap_collectives(modules, names, prefix, before)


def run(program: str, argv: list[str]) -> None:
    """Run ``program`` as ``__main__`` with ``argv``, every collective checked."""
    folder = os.path.dirname(os.path.abspath(program))
    mode = Provenance(folder)
    _guard(mode, (dist, dist.distributed_c10d), COLLECTIVES, "torch.distributed.")
    _guard(mode, (funcol,), FUNCTIONAL, "functional ")
    sys.argv = [program, *argv]
    sys.path.insert(0, folder)
    with mode:
        runpy.run_path(program, run_name="__main__")


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m ddpguide.core.collective_devices PROGRAM [ARGS...]\n")
        raise SystemExit(2)
    if not os.path.isfile(sys.argv[1]):
        sys.stderr.write(f"collective_devices: {sys.argv[1]}: no such file\n")
        raise SystemExit(2)
    run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
