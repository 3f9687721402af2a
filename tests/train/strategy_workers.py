"""A spawned worker for the strategy tests: three runs of the one loop in one process group."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset

from ddpguide.core.data import DataSplits
from ddpguide.elastic.worker import toy_data
from ddpguide.train.loop import TrainConfig, fit


def _files(path: str) -> dict[str, bytes]:
    """Every file under ``path`` (or its fallback), by name: a checkpoint's bytes."""
    found = {}
    for root in (path, path + ".prev"):
        if os.path.isfile(root):
            found[root] = open(root, "rb").read()
        for folder, _, names in os.walk(root):
            for name in names:
                found[os.path.join(folder, name)] = open(os.path.join(folder, name), "rb").read()
    return found


def three_runs(strategy, checkpoint: str) -> dict:
    """Two epochs; a third with no data (no step: nothing saved); the third again, with data."""
    def config(epochs: int) -> TrainConfig:
        return TrainConfig(model="toy", epochs=epochs, batch_size=8, checkpoint=checkpoint,
                           log=False, progress=False)

    data = toy_data(64)
    empty = DataSplits("toy", TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)),
                       data.test)
    first = fit(config(2), data=data, strategy=strategy)
    saved = _files(checkpoint)
    idle = fit(config(3), data=empty, strategy=strategy)
    untouched = _files(checkpoint) == saved
    last = fit(config(3), data=data, strategy=strategy)
    return {"first": first, "idle": idle, "untouched": untouched, "last": last}
