"""Every strategy through the one loop (:func:`ddpguide.train.loop.fit`), with the same semantics.

DDP (:class:`ddpguide.train.strategy.DDP`) and FSDP2
(:class:`ddpguide.sharding.fsdp_strategy.FSDP2`) each run three times in one
2-rank group: two epochs; a third epoch with no data, which takes no step and
so must leave the checkpoint byte for byte as it was; the third epoch again,
resumed after epoch 1. Both end where one process replaying the same steps ends.
"""

from __future__ import annotations

import pytest
import torch

from ddpguide.elastic.worker import toy_data
from ddpguide.launch.spawn import run_several, spawn
from ddpguide.sharding.fsdp_strategy import FSDP2, replay
from ddpguide.train.loop import TrainConfig
from ddpguide.train.strategy import DDP

TOLERANCE = 1e-6  # float32 sums in another order (ranks' gradients reduced, not one batch)
STRATEGIES = {"ddp": DDP(), "fsdp": FSDP2()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.train.strategy_workers import three_runs

    folder = tmp_path_factory.mktemp("strategies")
    calls = {name: (three_runs, strategy, str(folder / f"{name}-checkpoint"))
             for name, strategy in STRATEGIES.items()}
    return spawn(run_several, 2, calls, timeout=240, echo=False)


def _gap(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert params.keys() == reference.keys()
    return max((params[k] - reference[k]).abs().max().item() for k in params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_empty_epoch_and_checkpoint_are_the_same_for_every_strategy(runs, name):
    ranks = [r[name] for r in runs]
    first, idle, last = ranks[0]["first"], ranks[0]["idle"], ranks[0]["last"]
    assert [e.epoch for e in first.epochs] == [0, 1] and first.start_epoch == 0
    # The epoch without data: resumed at 2, took no step, saved nothing, added no history.
    assert idle.start_epoch == 2 and idle.step_losses == [] and len(idle.history) == 2
    assert all(r["untouched"] for r in ranks)
    # Then the same epoch with data, resumed after epoch 1 again.
    assert last.start_epoch == 2 and [h["epoch"] for h in last.history] == [0, 1, 2]
    assert last.history[:2] == first.history
    assert _gap(ranks[1]["last"].parameters, last.parameters) == 0.0
    config = TrainConfig(model="toy", epochs=3, batch_size=8, log=False)
    reference = replay(config, toy_data(64), [2, 2, 2])
    assert _gap(last.parameters, reference) < TOLERANCE
    # and the check can fail: one epoch fewer ends elsewhere
    assert _gap(last.parameters, replay(config, toy_data(64), [2, 2])) > 1e-4


def test_a_sharded_strategy_says_so_and_refuses_what_it_cannot_train():
    assert (DDP().sharded, FSDP2().sharded) == (False, True)
    with pytest.raises(ValueError, match="amp 'fp16' needs a sharded gradient scaler"):
        FSDP2().check(TrainConfig(amp="fp16"))
    DDP().check(TrainConfig(amp="fp16"))
