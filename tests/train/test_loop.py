import pytest
import torch

from ddpguide.core.models import ConvNet, ToyModel, build_model
from ddpguide.launch.spawn import spawn
from ddpguide.train.loop import TrainConfig, fit
from tests.train.equivalence_workers import (
    ddp_parameters_worker,
    max_abs_difference,
    single_process_parameters,
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size, dtype, tolerance", [
    (2, "float64", 1e-12), (4, "float64", 1e-12), (2, "float32", 1e-5),
])
def test_ddp_equals_one_process_on_the_whole_batch(world_size, dtype, tolerance):
    reference = single_process_parameters(steps=5, global_batch=16, dtype=dtype)
    results = spawn(ddp_parameters_worker, world_size, 5, 16, dtype, timeout=90)
    for params in results:
        assert max_abs_difference(params, reference) <= tolerance
    # and the check can fail: a different number of steps gives different weights
    assert max_abs_difference(single_process_parameters(steps=4, global_batch=16, dtype=dtype),
                              reference) > 1e-4


@pytest.mark.timeout(150)
def test_spawned_training_learns_and_ranks_agree():
    config = TrainConfig(epochs=2, batch_size=32, max_steps_per_epoch=15, log=False)
    results = spawn(fit, 2, config, timeout=120)
    first, second = results
    assert [e.epoch for e in first.epochs] == [0, 1]
    assert first.epochs[-1].train_loss < first.epochs[0].train_loss
    assert first.test_total == 359  # the digits test split, each sample counted once
    assert first.accuracy > 0.5
    assert max_abs_difference(first.parameters, second.parameters) == 0.0


def test_single_process_fit_without_a_process_group():
    result = fit(TrainConfig(epochs=1, max_steps_per_epoch=5, log=False))
    assert result.world_size == 1 and result.test_total == 359


@pytest.mark.parametrize("change, message", [
    ({"epochs": -1}, "epochs must be >= 0, got -1"),
    ({"batch_size": 0}, "batch size must be >= 1, got 0"),
    ({"lr": 0}, "learning rate must be > 0, got 0"),
    ({"amp": "fp8"}, "unknown amp mode 'fp8': choose one of off, auto, bf16, fp16"),
])
def test_bad_config_is_rejected_with_one_sentence(change, message):
    with pytest.raises(ValueError) as info:
        TrainConfig(**change).validate()
    assert str(info.value) == message


def test_models_from_the_sources():
    assert ToyModel()(torch.zeros(3, 10)).shape == (3, 5)
    assert ConvNet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert ConvNet(image_size=8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="image_size must be divisible by 4, got 30"):
        ConvNet(image_size=30)
    with pytest.raises(ValueError, match="unknown model 'resnet': choose one of toy, convnet"):
        build_model("resnet")


def test_an_epoch_without_a_step_leaves_the_checkpoint_alone(tmp_path):
    """No data means no step: nothing is saved, the good checkpoint and its fallback stay."""
    from torch.utils.data import TensorDataset

    from ddpguide.core.checkpoint import previous_path, save_checkpoint, training_state
    from ddpguide.core.data import DataSplits

    ckpt = tmp_path / "checkpoint.pt"
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # the latest and its .prev
        save_checkpoint(training_state(0, model, optimizer, history=[]), ckpt)
    before = {p: p.read_bytes() for p in (ckpt, previous_path(ckpt))}
    test_set = TensorDataset(torch.randn(8, 10), torch.zeros(8, dtype=torch.long))

    def run(samples: int):
        data = DataSplits("toy", TensorDataset(torch.randn(samples, 10),
                                               torch.zeros(samples, dtype=torch.long)), test_set)
        return fit(TrainConfig(model="toy", epochs=3, batch_size=4, checkpoint=str(ckpt),
                               log=False), data=data)

    empty = run(0)
    assert [e.epoch for e in empty.epochs] == [1, 2] and empty.step_losses == []
    assert empty.history == []
    assert {p: p.read_bytes() for p in before} == before
    # and the check can fail: one sample is a step, and the step is saved
    one = run(1)
    assert len(one.step_losses) == 2 and [h["epoch"] for h in one.history] == [1, 2]
    assert ckpt.read_bytes() != before[ckpt]
