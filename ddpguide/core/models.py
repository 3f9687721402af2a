"""The package's models: those of the source articles, small enough to train on a laptop
CPU, and the plain stacks its checks and benchmarks build.

A chapter's program keeps its own models (it imports no package); a check of
a program loads the program's (:func:`ddpguide.launch.programs.load`), never a
copy kept here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


class ToyModel(nn.Module):
    """Linear 10-10, ReLU, Linear 10-5: the model of the DDP and elastic tutorials."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net2(self.relu(self.net1(x)))
        return out


class ConvNet(nn.Module):
    """The small CNN of the mixed-precision article: two conv blocks and a linear head.

    ``image_size`` must be divisible by 4 (two 2x2 max-pools); 28 for MNIST and
    for the bundled digits, which the data module resizes to 28x28.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 width: int = 16) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size must be divisible by 4, got {image_size}")
        self.layer1 = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.layer2 = nn.Sequential(
            nn.Conv2d(width, 2 * width, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.fc = nn.Linear((image_size // 4) ** 2 * 2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer2(self.layer1(x))
        logits: torch.Tensor = self.fc(out.flatten(1))
        return logits


class MLP(nn.Module):
    """Linear up, GELU, Linear down (the feed-forward half of a transformer layer)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class Stack(nn.Module):
    """``layers`` residual MLPs: ``x + mlp(x)`` each (FSDP's units, one per layer)."""

    def __init__(self, dim: int, hidden: int, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def mlp(widths: tuple[int, ...], activation: Callable[[], nn.Module] = nn.Tanh,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> nn.Sequential:
    """``Linear(w0, w1), act, Linear(w1, w2), act, ..., Linear(w[-2], w[-1])``."""
    if len(widths) < 2 or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be at least two positive integers, got {widths!r}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(activation())
        layers.append(nn.Linear(a, b, dtype=dtype, device=device))
    return nn.Sequential(*layers)


MODELS = {"toy": ToyModel, "convnet": ConvNet}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """A model by name (``toy`` or ``convnet``), with a clear error otherwise."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}") from None
    model: nn.Module = factory(**kwargs)
    return model
