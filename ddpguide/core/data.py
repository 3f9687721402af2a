"""Data: MNIST when its files are on disk, scikit-learn's bundled digits otherwise.

Nothing here downloads. ``torchvision.datasets.MNIST`` is used with
``download=False`` when the files exist under the configured root (argument,
or ``DDPGUIDE_MNIST_ROOT``, or ``./data``); otherwise the 1,797 real handwritten
8x8 digits that ship with scikit-learn are resized to 28x28 so the same
ConvNet trains on either.

Also here: the samplers and loaders of data-parallel training.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sized, cast

import torch
import torch.nn.functional as F
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    TensorDataset,
)

DEFAULT_SEED = 3407


@dataclass(frozen=True)
class DataSplits:
    """A train and a test set, with the name of where they came from."""

    name: str
    train: Dataset[Any]
    test: Dataset[Any]


def mnist_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Where MNIST is looked for: argument, ``DDPGUIDE_MNIST_ROOT``, or ``./data``."""
    return Path(root or os.environ.get("DDPGUIDE_MNIST_ROOT") or "data")


def mnist_available(root: str | os.PathLike[str] | None = None) -> bool:
    """True when torchvision's MNIST files are already on disk under ``root``."""
    raw = mnist_root(root) / "MNIST" / "raw"
    needed = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    return all((raw / name).exists() or (raw / f"{name}.gz").exists() for name in needed)


def load_mnist(root: str | os.PathLike[str] | None = None) -> DataSplits:
    """torchvision's MNIST, from local files only (never a download)."""
    from torchvision import datasets, transforms

    root = mnist_root(root)
    if not mnist_available(root):
        raise FileNotFoundError(
            f"MNIST files not found under {root / 'MNIST' / 'raw'}; "
            "download them once with torchvision or use the bundled digits"
        )
    to_tensor = transforms.ToTensor()
    train = datasets.MNIST(str(root), train=True, transform=to_tensor, download=False)
    test = datasets.MNIST(str(root), train=False, transform=to_tensor, download=False)
    return DataSplits("mnist", train, test)


def load_digits(image_size: int = 28, test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """scikit-learn's handwritten digits as 1 x image_size x image_size tensors in [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(labels) * test_fraction))
    test_idx, train_idx = order[:n_test], order[n_test:]
    return DataSplits(
        "digits",
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )


def load_dataset(name: str = "auto", root: str | os.PathLike[str] | None = None,
                 image_size: int = 28) -> DataSplits:
    """``mnist``, ``digits``, or ``auto`` (MNIST if its files exist, else digits)."""
    if name == "auto":
        name = "mnist" if mnist_available(root) else "digits"
    if name == "mnist":
        return load_mnist(root)
    if name == "digits":
        return load_digits(image_size=image_size)
    raise ValueError(f"unknown dataset {name!r}: choose auto, mnist or digits")


def rank_generator(rank: int, seed: int = DEFAULT_SEED) -> torch.Generator:
    """A generator seeded differently on every rank.

    Loader workers derive their seeds from the loader's generator; with the
    same seed everywhere, worker k of every rank would draw the same random
    augmentations.
    """
    return torch.Generator().manual_seed(seed + rank)


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank r gets indices r, r+N, r+2N, ...: disjoint, covering, never padded.

    ``DistributedSampler`` pads the last round with repeated samples so that
    every rank has the same number of batches (a DDP requirement for training).
    Evaluation needs no per-batch collective, so it can use uneven shards and
    count every sample exactly once.
    """

    def __init__(self, dataset_size: int, num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.num_replicas))

    def __len__(self) -> int:
        return max(0, math.ceil((self.dataset_size - self.rank) / self.num_replicas))


def train_loader(dataset: Dataset[Any], batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = DEFAULT_SEED, num_workers: int = 0,
                 drop_last: bool = False) -> DataLoader[Any]:
    """A shuffled loader whose sampler gives this rank its shard of every epoch.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch, or every epoch
    repeats the first one's order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      generator=rank_generator(rank, seed), drop_last=drop_last)


def eval_loader(dataset: Dataset[Any], batch_size: int, rank: int = 0,
                world_size: int = 1) -> DataLoader[Any]:
    """A loader over this rank's unpadded shard, so counts add up to ``len(dataset)``."""
    sampler = UnpaddedDistributedSampler(len(cast(Sized, dataset)), world_size, rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
