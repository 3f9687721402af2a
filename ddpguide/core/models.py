"""The models of the source articles, small enough to train on a laptop CPU."""

from __future__ import annotations

from typing import Any

import torch
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


MODELS = {"toy": ToyModel, "convnet": ConvNet}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """A model by name (``toy`` or ``convnet``), with a clear error otherwise."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}") from None
    model: nn.Module = factory(**kwargs)
    return model
