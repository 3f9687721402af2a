"""A spawned worker for the checkpoint tests: the elastic worker's training, in a
process group that ``spawn`` made."""

from ddpguide.elastic.worker import toy_data
from ddpguide.train.loop import TrainConfig, fit


def train_toy(epochs: int, checkpoint: str | None = None, samples: int = 256,
              batch_size: int = 16):
    """The same training in an existing process group (e.g. under ``launch.spawn``).

    Returns :class:`ddpguide.train.loop.TrainResult`; tests compare interrupted and
    uninterrupted runs with it.
    """
    config = TrainConfig(model="toy", epochs=epochs, batch_size=batch_size,
                         checkpoint=checkpoint, progress=False, log=False)
    return fit(config, data=toy_data(samples))
