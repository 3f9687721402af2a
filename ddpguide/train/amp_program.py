"""Mixed precision measured on the chapter's own model, ``book/programs/amp_ddp.py``'s ConvNet.

The program defines the model chapter 7 teaches; these functions import it by path
(:func:`ddpguide.launch.programs.load`, afresh on each call) and run the counters of
:mod:`ddpguide.train.amp` on it, so a reader who edits the program's model sees the
chapter's dtypes and memory figures change. The package keeps no copy of that model
(``core.models.ConvNet`` is the training loop's, for 28x28 images).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ddpguide.launch import programs
from ddpguide.train import amp

#: The chapter's program: its ``ConvNet`` is the model measured here.
PROGRAM = "amp_ddp.py"
#: The program's images: scikit-learn's 8x8 digits, one channel (its ``digits_splits``).
IMAGE = (1, 8, 8)


def convnet(program: str | os.PathLike = PROGRAM, seed: int = 0) -> nn.Module:
    """A new ``ConvNet`` of the program, its weights drawn from ``seed``."""
    source = programs.load(program)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = source.ConvNet()
    return model


def batch(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random images of the program's shape and their labels (0-9)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(size, *IMAGE, generator=generator),
            torch.randint(0, 10, (size,), generator=generator))


def layer_dtypes(mode: str = "bf16", size: int = 4,
                 program: str | os.PathLike = PROGRAM) -> list[tuple[str, str, torch.dtype]]:
    """(name, layer type, output dtype) of each of the program's layers under autocast (CPU)."""
    images, _ = batch(size)
    return amp.layer_dtypes(convnet(program), images, amp.resolve_amp(mode, "cpu"))


def activation_memory(size: int, modes: tuple[str, ...] = ("off", "bf16"),
                      program: str | os.PathLike = PROGRAM) -> dict[str, dict[torch.dtype, int]]:
    """Bytes the program's ConvNet saves for backward on ``size`` images, by mode and dtype.

    One training forward pass and its cross-entropy loss per mode (``off``: float32), on
    the same images and the same weights, counted by :func:`ddpguide.train.amp.saved_activations`.
    """
    images, labels = batch(size)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels)

    return {mode: amp.saved_activations(convnet(program), images, amp.resolve_amp(mode, "cpu"), loss)
            for mode in modes}
