"""Model parallelism in one process: the split models compute what the unsplit ones do.

ResNet50 runs at 32x32 with a batch of 8 to stay fast. Forward equality with the
full batch is checked in eval mode, where BatchNorm uses running statistics and
treats samples independently; in train mode each micro-batch is normalised with
its own statistics, so the reference is gradient accumulation over the same
micro-batches (:func:`microbatch_reference`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpguide.core.models import ToyModel as PlainToyModel
from ddpguide.pipeline import model_parallel as mp
from ddpguide.pipeline.stages import batch_loss

TOL = 1e-5
BATCH = 8
# The ResNet checks run on the CPU wherever they run: one thread, the reference's kernels.
CPU = ("cpu", "cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: the same arithmetic on every machine, and no OpenMP barrier
    stalls when a shared CI machine is oversubscribed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.set_num_threads(threads)
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def plain_step(model: nn.Module, x, y):
    """Output, loss and gradients under torchvision's names (split aliases left out)."""
    return mp.forward_backward(model, x, y, batch_loss(x.shape[0]))


def test_default_devices_are_cpu_without_two_gpus(monkeypatch):
    monkeypatch.delenv("DDPGUIDE_DEVICE", raising=False)
    monkeypatch.delenv("DDPGUIDE_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert mp.default_devices() == (torch.device("cpu"), torch.device("cpu"))


def test_default_devices_are_two_gpus_when_present(monkeypatch):
    monkeypatch.delenv("DDPGUIDE_DEVICE", raising=False)
    monkeypatch.delenv("DDPGUIDE_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert mp.default_devices() == (torch.device("cuda", 0), torch.device("cuda", 1))


def test_two_devices_are_required():
    with pytest.raises(ValueError, match="^expected two devices, got 3$"):
        mp.TwoDeviceToyModel(devices=["cpu", "cpu", "cpu"])


def test_toy_model_on_two_devices_matches_one_device():
    torch.manual_seed(0)
    plain = PlainToyModel()
    split = mp.TwoDeviceToyModel()
    split.load_state_dict(plain.state_dict())
    x, labels = torch.randn(20, 10), torch.randn(20, 5)
    losses = []
    for model in (plain, split):
        out = model(x)
        loss = nn.functional.mse_loss(out, labels.to(out.device))
        loss.backward()
        losses.append(loss.detach().cpu())
    assert mp.max_scaled_error(losses[1], losses[0]) <= TOL
    assert mp.max_scaled_error(grads_of(split), grads_of(plain)) <= TOL


@pytest.fixture(scope="module")
def seed_weights():
    torch.manual_seed(0)
    return mp.resnet_state_dict(mp.ModelParallelResNet50(num_classes=10, devices=CPU))


def test_unsplit_copy_has_the_same_weights(seed_weights):
    split = mp.ModelParallelResNet50(num_classes=10, devices=CPU)
    mp.load_resnet_weights(split, seed_weights)
    plain = mp.unsplit_resnet50(split)
    assert plain.state_dict().keys() == seed_weights.keys()
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in seed_weights.items())
    # seq1/seq2 share the ResNet's modules: one set of parameters, not two.
    assert split.seq1[0] is split.conv1 and split.seq2[0] is split.layer3


def test_load_resnet_weights_rejects_foreign_keys(seed_weights):
    split = mp.ModelParallelResNet50(num_classes=10, devices=CPU)
    bad = dict(seed_weights, extra=torch.zeros(1))
    with pytest.raises(KeyError, match="unexpected \\['extra'\\]"):
        mp.load_resnet_weights(split, bad)


@pytest.fixture(scope="module")
def eval_reference(seed_weights, data):
    """Output, loss and gradients of the plain ResNet50 on the full batch, in eval mode."""
    x, y = data
    plain = mp.unsplit_resnet50(mp.ModelParallelResNet50(num_classes=10, devices=CPU))
    plain.load_state_dict(seed_weights)
    return plain_step(plain.eval(), x, y)


def test_model_parallel_resnet_matches_unsplit(seed_weights, data, eval_reference):
    x, y = data
    split = mp.ModelParallelResNet50(num_classes=10, devices=CPU).eval()
    mp.load_resnet_weights(split, seed_weights)
    out, loss, grads = eval_reference
    out2, loss2, split_grads = plain_step(split, x, y)
    assert mp.max_scaled_error(out2, out) <= TOL
    assert mp.max_scaled_error(loss2, loss) <= TOL
    assert mp.max_scaled_error(split_grads, grads) <= TOL


@pytest.mark.parametrize("split_size", [3, 8, 20], ids=["3-ragged", "equal-batch", "larger-than-batch"])
def test_pipelined_resnet_matches_unsplit_in_eval_mode(seed_weights, data, eval_reference, split_size):
    x, y = data
    model = mp.PipelineParallelResNet50(split_size=split_size, num_classes=10, devices=CPU).eval()
    mp.load_resnet_weights(model, seed_weights)
    out, loss, grads = eval_reference
    out2, loss2, split_grads = plain_step(model, x, y)
    assert out2.shape == out.shape
    assert mp.max_scaled_error(out2, out) <= TOL
    assert mp.max_scaled_error(loss2, loss) <= TOL
    assert mp.max_scaled_error(split_grads, grads) <= TOL


def test_pipelined_resnet_in_train_mode_is_microbatch_accumulation(seed_weights, data):
    x, y = data
    model = mp.PipelineParallelResNet50(split_size=4, num_classes=10, devices=CPU).train()
    mp.load_resnet_weights(model, seed_weights)
    reference = mp.unsplit_resnet50(model)
    out, loss = mp.microbatch_reference(reference, x, y, 4, batch_loss(BATCH))
    out2, loss2, grads2 = plain_step(model, x, y)
    assert mp.max_scaled_error(out2, out) <= TOL
    assert mp.max_scaled_error(loss2, loss) <= TOL
    assert mp.max_scaled_error(grads2, grads_of(reference)) <= TOL
    # BatchNorm statistics per micro-batch: the full batch really gives other outputs.
    full_out = mp.unsplit_resnet50(model).train()(x).detach()
    assert mp.max_scaled_error(out2, full_out) > 1e-3


@pytest.mark.parametrize("bad", [0, -3])
def test_split_size_must_be_positive(bad):
    with pytest.raises(ValueError) as info:
        mp.PipelineParallelResNet50(split_size=bad)
    assert str(info.value) == f"split_size must be a positive integer, got {bad}"


def test_split_size_is_checked_when_changed_later():
    model = mp.PipelineParallelResNet50(split_size=4)
    with pytest.raises(ValueError) as info:
        model.split_size = 0
    assert str(info.value) == "split_size must be a positive integer, got 0"
    assert model.split_size == 4


def test_microbatch_reference_checks_split_size(data):
    x, y = data
    with pytest.raises(ValueError) as info:
        mp.microbatch_reference(nn.Flatten(), x, y, -1, batch_loss(BATCH))
    assert str(info.value) == "split_size must be a positive integer, got -1"
