"""Mixed precision settings chosen for the device: bfloat16 on CPU, float16 + GradScaler on CUDA.

Only the ``torch.amp`` spellings are used (``torch.cuda.amp`` is deprecated).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

AMP_CHOICES = ("off", "auto", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    CPU works but is far slower than float32 there, so it warns.
    """
    choice = (amp or "off").lower()
    if choice not in AMP_CHOICES:
        raise ValueError(f"unknown amp mode {amp!r}: choose one of {', '.join(AMP_CHOICES)}")
    if choice == "off":
        return AmpSettings(device_type, None)
    if choice == "auto":
        choice = "fp16" if device_type == "cuda" else "bf16"
    if choice == "fp16" and device_type == "cpu":
        warnings.warn("float16 autocast on CPU runs many times slower than float32; "
                      "use bf16 on CPU", RuntimeWarning, stacklevel=2)
    return AmpSettings(device_type, _DTYPES[choice])


def autocast(settings: AmpSettings):
    """The autocast context for these settings (a no-op context when AMP is off)."""
    if not settings.enabled:
        return contextlib.nullcontext()
    return torch.autocast(settings.device_type, dtype=settings.dtype)


def make_scaler(settings: AmpSettings) -> torch.amp.GradScaler:
    """A GradScaler that is active only where the dtype needs one (float16)."""
    return torch.amp.GradScaler(settings.device_type, enabled=settings.needs_scaler)
