"""Mixed precision: training-step time and activation memory, fp32 beside bf16 (and fp16 on GPUs).

``python -m ddpguide.bench amp [--quick] [--json FILE]``

Both precisions train the same ConvNet on the same batch in one fresh process
(with the allocator settings of :data:`~ddpguide.bench.report.MALLOC_ENV`; ``--quick``:
a process forked from the warm server, fewer rounds), their timed steps interleaved so
that a noisy machine slows both alike.

Memory is measured two ways:

* ``activations``: bytes autograd saves for backward during one forward pass
  (:func:`ddpguide.train.amp.saved_activation_bytes`), on every device. It is
  deterministic and it is what mixed precision shrinks; process RSS on CPU is
  neither (the allocator keeps freed pages, other work shares the process);
* ``peak``: ``torch.cuda.max_memory_allocated`` during one step, on GPUs only.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ddpguide.bench.progress import tick, tracked
from ddpguide.bench.report import MALLOC_ENV, Report
from ddpguide.core.models import ConvNet
from ddpguide.core.runtime import select_runtime
from ddpguide.launch.spawn import spawn
from ddpguide.train.amp import (
    AmpSettings,
    autocast,
    cpu_has_native_bf16,
    make_scaler,
    resolve_amp,
    saved_activation_bytes,
)

MIB = 2 ** 20
NAMES = {"off": "fp32", "bf16": "bf16", "fp16": "fp16"}  # the report's name of each mode


def _repeats(quick: bool) -> tuple[int, int]:
    """Timed rounds and warm-up steps."""
    return (5, 2) if quick else (15, 3)


def _modes(device_type: str) -> list[str]:
    if device_type != "cuda":
        return ["off", "bf16"]  # fp16 on CPU is an order of magnitude slower: not worth timing
    modes = ["off", "fp16"]
    if torch.cuda.is_bf16_supported():
        modes.insert(1, "bf16")
    return modes


class _Trainer:
    """One model, optimiser and scaler per precision, all starting from the same weights."""

    def __init__(self, settings: AmpSettings, device: torch.device, width: int) -> None:
        torch.manual_seed(0)
        self.settings = settings
        self.device = device
        self.model = ConvNet(width=width).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.scaler = make_scaler(settings)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with autocast(self.settings):
            loss = nn.functional.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(quick: bool) -> dict:
    """Step times (seconds) and memory (bytes) per precision; runs in the calling process."""
    runtime = select_runtime(1)
    device = runtime.device(0)
    batch, width = 256, 16
    repeats, warmup = _repeats(quick)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch,), generator=generator).to(device)
    trainers = {mode: _Trainer(resolve_amp(mode, device.type), device, width)
                for mode in _modes(device.type)}
    out: dict = {"device": str(device), "batch": batch, "width": width, "threads":
                 torch.get_num_threads(), "modes": {}}
    for mode, trainer in trainers.items():
        for _ in range(warmup):
            trainer.step(images, labels)
        out["modes"][mode] = {"times": [], "activations": saved_activation_bytes(
            trainer.model, images, trainer.settings,
            lambda logits: nn.functional.cross_entropy(logits, labels))}
        tick(f"{NAMES[mode]}: warm-up, activations",
             [(f"{NAMES[mode]} activations", out["modes"][mode]["activations"] / MIB, "MiB")])
    for k in range(repeats):  # interleaved: fp32, bf16, fp32, bf16, ...
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(images, labels)
            out["modes"][mode]["times"].append(time.perf_counter() - start)
        tick(f"round {k + 1} of {repeats}", [(f"{NAMES[mode]} step", times["times"][-1] * 1e3, "ms")
                                             for mode, times in out["modes"].items()])
    if device.type == "cuda":
        for mode, trainer in trainers.items():
            torch.cuda.reset_peak_memory_stats(device)
            trainer.step(images, labels)
            out["modes"][mode]["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def run(quick: bool) -> Report:
    """The suite: one fresh process (with the allocator settings of ``MALLOC_ENV``) measures
    every precision side by side; ``quick``, one forked from the warm server, with fewer rounds."""
    report = Report("amp")
    modes = _modes(select_runtime(1).device(0).type)
    with tracked(report, total=len(modes) + _repeats(quick)[0]):  # the worker ticks
        (result,) = spawn(measure, 1, quick, env=None if quick else MALLOC_ENV, echo=False,
                          timeout=600)
    names = NAMES
    details = {"model": f"ConvNet(width={result['width']})", "batch": result["batch"],
               "device": result["device"], "threads": result["threads"]}
    modes = result["modes"]
    for mode, values in modes.items():
        report.add(f"{names[mode]} step", statistics.median(values["times"]) * 1e3, "ms",
                   repeats=len(values["times"]), **details)
    for mode, values in modes.items():
        report.add(f"{names[mode]} activations", values["activations"] / MIB, "MiB",
                   method="saved_tensors_hooks", **details)
    for mode, values in modes.items():
        if "peak" in values:
            report.add(f"{names[mode]} peak", values["peak"] / MIB, "MiB",
                       method="torch.cuda.max_memory_allocated", **details)
    fp32 = modes["off"]
    for mode in ("bf16", "fp16"):
        if mode in modes:
            report.ratios[f"{mode}_over_fp32_time"] = (statistics.median(modes[mode]["times"])
                                                       / statistics.median(fp32["times"]))
            report.ratios[f"{mode}_over_fp32_memory"] = (modes[mode]["activations"]
                                                         / fp32["activations"])
    if result["device"] == "cpu":
        report.notes.append(
            "CPU with native bfloat16 instructions: "
            f"{'yes' if cpu_has_native_bf16() else 'no (bf16 is emulated, rarely faster)'}; "
            "float16 is not timed on CPU (many times slower than float32).")
    report.notes.append("activations: bytes saved for backward in one forward pass, "
                        "parameters excluded, autocast's weight copies included.")
    return report
