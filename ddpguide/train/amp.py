"""Mixed precision settings chosen for the device: bfloat16 on CPU, float16 + GradScaler on CUDA.

Only the ``torch.amp`` spellings are used (``torch.cuda.amp`` is deprecated).
The choice, in one table:

====== ============================ ============================================
mode   CPU                          CUDA
====== ============================ ============================================
off    float32                      float32
auto   bfloat16, no scaler          float16 + GradScaler
bf16   bfloat16, no scaler          bfloat16, no scaler (needs compute cap. 8+)
fp16   float16 + scaler, warns:     float16 + GradScaler
       many times slower than fp32
====== ============================ ============================================

float16 has a 5-bit exponent: gradients below about 6e-8 flush to zero, so the
loss is multiplied by a large factor before ``backward`` and the gradients are
divided by it before the optimiser step (``GradScaler``). bfloat16 keeps
float32's 8-bit exponent and needs no scaling.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

AMP_CHOICES = ("off", "auto", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_ON_CPU_WARNING = ("float16 autocast on CPU runs many times slower than float32; "
                       "use bf16 on CPU")


@dataclass(frozen=True)
class AmpSettings:
    """Whether autocast is on, with which dtype, and whether a GradScaler is needed."""

    device_type: str
    dtype: torch.dtype | None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def needs_scaler(self) -> bool:
        # float16 has a narrow exponent range: small gradients underflow to zero
        # unless the loss is scaled up first. bfloat16 has float32's range.
        return self.dtype == torch.float16

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def resolve_amp(amp: str | None, device_type: str) -> AmpSettings:
    """Turn ``off``/``auto``/``bf16``/``fp16`` into settings valid on ``device_type``.

    ``auto`` picks float16 on CUDA and bfloat16 on CPU. Asking for float16 on
    CPU works but is far slower than float32 there, so it warns
    (``RuntimeWarning``). bfloat16 on a GPU without bfloat16 support and an
    unknown mode raise ``ValueError``.
    """
    choice = (amp or "off").lower()
    if choice not in AMP_CHOICES:
        raise ValueError(f"unknown amp mode {amp!r}: choose one of {', '.join(AMP_CHOICES)}")
    if choice == "off":
        return AmpSettings(device_type, None)
    if choice == "auto":
        choice = "fp16" if device_type == "cuda" else "bf16"
    if choice == "fp16" and device_type == "cpu":
        warnings.warn(FP16_ON_CPU_WARNING, RuntimeWarning, stacklevel=2)
    if (choice == "bf16" and device_type == "cuda" and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()):
        raise ValueError("bf16 autocast needs a GPU with bfloat16 support "
                         "(compute capability 8.0 or newer); use fp16")
    return AmpSettings(device_type, _DTYPES[choice])


def autocast(settings: AmpSettings):
    """The autocast context for these settings (a no-op context when AMP is off)."""
    if not settings.enabled:
        return contextlib.nullcontext()
    return torch.autocast(settings.device_type, dtype=settings.dtype)


def make_scaler(settings: AmpSettings) -> torch.amp.GradScaler:
    """A GradScaler that is active only where the dtype needs one (float16).

    A disabled scaler passes ``scale``/``step``/``update`` straight through, so
    the training loop is the same for every mode. Its ``state_dict`` belongs in
    checkpoints: the current scale is learnt during training, and a resumed
    run that starts again from 65536 skips steps to find it anew.
    """
    return torch.amp.GradScaler(settings.device_type, enabled=settings.needs_scaler)


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bfloat16 instructions (AVX-512 BF16 or AMX), Linux only.

    Without them bfloat16 autocast still runs, emulated, and is rarely faster
    than float32.
    """
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return False
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def saved_activations(model: nn.Module, inputs: torch.Tensor, settings: AmpSettings,
                      loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> dict[torch.dtype, int]:
    """Bytes autograd keeps between forward and backward for one step, by dtype.

    Every tensor saved for backward passes through a ``saved_tensors_hooks``
    pack hook; storages are counted once, and the model's own parameters are
    left out (they exist whatever the precision). The half-precision copies of
    the weights that autocast makes *are* counted: they are extra memory.
    Deterministic, unlike process RSS, and the quantity mixed precision shrinks.
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            storages[storage.data_ptr()] = (tensor.dtype, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with autocast(settings):
            output = model(inputs)
            loss = loss_fn(output) if loss_fn is not None else output.float().sum()
    del loss, output
    by_dtype: dict[torch.dtype, int] = {}
    for dtype, nbytes in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return by_dtype


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, settings: AmpSettings,
                           loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
    """Total of :func:`saved_activations`: the activation memory of one training step."""
    return sum(saved_activations(model, inputs, settings, loss_fn).values())


def layer_dtypes(model: nn.Module, inputs: torch.Tensor,
                 settings: AmpSettings) -> list[tuple[str, str, torch.dtype]]:
    """(name, layer type, output dtype) of every leaf module in one forward pass under ``settings``."""
    seen: list[tuple[str, str, torch.dtype]] = []
    hooks = [module.register_forward_hook(
                 lambda mod, args, out, name=name: seen.append((name, type(mod).__name__, out.dtype)))
             for name, module in model.named_modules() if not list(module.children())]
    try:
        with torch.no_grad(), autocast(settings):
            model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen
