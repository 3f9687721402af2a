"""Workers for the checkpoint tests: the elastic worker's training, in a process group
that ``spawn`` made, and a process that saves checkpoints until it is killed."""

import torch

from ddpguide.core.checkpoint import save_checkpoint
from ddpguide.core.processes import die_with_parent
from ddpguide.elastic.worker import toy_data
from ddpguide.train.loop import TrainConfig, fit

#: 8 MB of float32: a write takes long enough to be interrupted
BIG = 2_000_000


def big_tensor() -> torch.Tensor:
    """The weights :func:`save_forever` saves (plus its epoch)."""
    return torch.randn(BIG, generator=torch.Generator().manual_seed(0))


def save_forever(path: str, saved) -> None:
    """Save epoch 0, 1, 2, ... of ``big_tensor() + epoch`` at ``path`` until killed (or its
    parent, the warm server, ends); send ``"saved"`` through the connection ``saved`` after
    the first."""
    die_with_parent()
    big = big_tensor()
    epoch = 0
    while True:
        save_checkpoint({"epoch": epoch, "model": {"w": big + epoch}}, path)
        if epoch == 0:
            saved.send("saved")
        epoch += 1


def train_toy(epochs: int, checkpoint: str | None = None, samples: int = 256,
              batch_size: int = 16):
    """The same training in an existing process group (e.g. under ``launch.spawn``).

    Returns :class:`ddpguide.train.loop.TrainResult`; tests compare interrupted and
    uninterrupted runs with it.
    """
    config = TrainConfig(model="toy", epochs=epochs, batch_size=batch_size,
                         checkpoint=checkpoint, progress=False, log=False)
    return fit(config, data=toy_data(samples))
