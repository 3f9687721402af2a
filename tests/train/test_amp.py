"""Mixed precision: the dtype choice, autocast, GradScaler in checkpoints, bf16 vs fp32 training."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from ddpguide.core.checkpoint import (
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from ddpguide.core.models import ConvNet
from ddpguide.train import amp
from ddpguide.train.loop import TrainConfig, fit


@pytest.mark.parametrize("mode, device_type, name, scaler", [
    ("off", "cpu", "fp32", False),
    (None, "cpu", "fp32", False),
    ("auto", "cpu", "bf16", False),
    ("BF16", "cpu", "bf16", False),
    ("off", "cuda", "fp32", False),
    ("auto", "cuda", "fp16", True),
    ("fp16", "cuda", "fp16", True),
])
def test_resolve_amp_picks_dtype_and_scaler(mode, device_type, name, scaler):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        settings = amp.resolve_amp(mode, device_type)
    assert settings.name == name
    assert settings.needs_scaler is scaler
    assert settings.enabled is (name != "fp32")
    if device_type == "cpu" or torch.cuda.is_available():  # GradScaler("cuda") needs CUDA
        assert amp.make_scaler(settings).is_enabled() is scaler


def test_float16_on_cpu_requested_explicitly_warns():
    with pytest.warns(RuntimeWarning) as caught:
        settings = amp.resolve_amp("fp16", "cpu")
    assert [str(w.message) for w in caught] == [
        "float16 autocast on CPU runs many times slower than float32; use bf16 on CPU"]
    assert settings.dtype == torch.float16 and settings.needs_scaler


@pytest.mark.parametrize("mode", ["fp8", "float16", "half"])
def test_unknown_amp_mode_is_a_value_error_with_the_choices(mode):
    with pytest.raises(ValueError) as info:
        amp.resolve_amp(mode, "cpu")
    assert str(info.value) == f"unknown amp mode '{mode}': choose one of off, auto, bf16, fp16"


@pytest.mark.parametrize("mode, dtype", [("off", torch.float32), ("bf16", torch.bfloat16)])
def test_autocast_runs_the_convnet_in_the_chosen_dtype(mode, dtype):
    torch.manual_seed(0)
    model, images = ConvNet(), torch.rand(4, 1, 28, 28)
    with amp.autocast(amp.resolve_amp(mode, "cpu")):
        logits = model(images)
        loss = nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    assert logits.dtype == dtype
    assert loss.dtype == torch.float32  # autocast computes losses in float32
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


def test_saved_activation_bytes_counts_what_backward_keeps():
    # Two Linear(64, 64) on a batch of 32: backward keeps both layers' inputs
    # (32 x 64 each); the second layer also needs its weight. In fp32 that is
    # the parameter itself (not counted); under autocast a bf16 copy (counted).
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), torch.randn(32, 64)
    fp32 = amp.saved_activation_bytes(model, x, amp.resolve_amp("off", "cpu"))
    bf16 = amp.saved_activation_bytes(model, x, amp.resolve_amp("bf16", "cpu"))
    assert fp32 == 2 * 32 * 64 * 4
    assert bf16 == 2 * 32 * 64 * 2 + 64 * 64 * 2
    conv_fp32 = amp.saved_activation_bytes(ConvNet(), torch.rand(64, 1, 28, 28),
                                           amp.resolve_amp("off", "cpu"))
    conv_bf16 = amp.saved_activation_bytes(ConvNet(), torch.rand(64, 1, 28, 28),
                                           amp.resolve_amp("bf16", "cpu"))
    # Max-pool indices stay int64, so the ConvNet's saving is less than half.
    assert 0.5 < conv_bf16 / conv_fp32 < 0.75


def _scaler_after_overflow() -> tuple[torch.amp.GradScaler, nn.Module, torch.optim.Optimizer]:
    """An enabled CPU GradScaler whose scale was halved by an overflowing step, then grew."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for value in (float("inf"), 1.0, 1.0, 1.0):
        optimizer.zero_grad()
        scaler.scale(model(torch.full((2, 3), value)).sum()).backward()
        scaler.step(optimizer)  # skipped when the gradients are not finite
        scaler.update()
    return scaler, model, optimizer


def test_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    scaler, model, optimizer = _scaler_after_overflow()
    state = scaler.state_dict()
    assert state["scale"] == 2.0 ** 16  # halved once, doubled after two good steps
    assert state["_growth_tracker"] == 1  # one good step towards the next doubling
    save_checkpoint(training_state(0, model, optimizer, scaler), tmp_path / "ckpt.pt")
    restored = torch.amp.GradScaler("cpu", growth_interval=2)
    next_epoch = restore_training_state(load_checkpoint(tmp_path / "ckpt.pt"), nn.Linear(3, 1),
                                        torch.optim.SGD(model.parameters(), lr=0.1), restored)
    assert next_epoch == 1
    assert restored.state_dict() == state
    assert restored.get_scale() == scaler.get_scale() == 2.0 ** 16


@pytest.fixture
def one_thread():
    """Train with one thread: on a busy machine, two spinning threads per process crawl."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fp16_config(tmp_path, epochs: int, name: str = "ckpt.pt") -> TrainConfig:
    # lr 0.05: the first steps after the resume still overflow at the initial scale, so
    # a resume that forgets the scaler state visibly diverges (the check below can fail).
    return TrainConfig(amp="fp16", epochs=epochs, lr=0.05, max_steps_per_epoch=3, batch_size=16,
                       dataset="digits", evaluate=False, log=False,
                       checkpoint=str(tmp_path / name))


@pytest.mark.timeout(180)
def test_resumed_fp16_training_with_its_scaler_continues_identically(tmp_path, one_thread):
    for folder in ("whole", "forgetful"):
        (tmp_path / folder).mkdir()
    with pytest.warns(RuntimeWarning, match="float16 autocast on CPU"):
        whole = fit(_fp16_config(tmp_path / "whole", 2))
        fit(_fp16_config(tmp_path, 1))
        state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        # The first fp16 steps overflow at the initial scale: the learnt scale is smaller,
        # so a resume that forgot it would repeat those skipped steps.
        assert state["scaler"]["scale"] < 2.0 ** 16
        resumed = fit(_fp16_config(tmp_path, 2))
        state.pop("scaler")
        torch.save(state, tmp_path / "forgetful" / "ckpt.pt")
        forgetful = fit(_fp16_config(tmp_path / "forgetful", 2))
    assert resumed.start_epoch == 1
    assert resumed.step_losses == whole.step_losses[3:]
    for key, value in whole.parameters.items():
        assert torch.equal(resumed.parameters[key], value), key
    assert any(not torch.equal(forgetful.parameters[k], v) for k, v in whole.parameters.items())


@pytest.mark.timeout(120)
def test_bf16_training_tracks_fp32_within_tolerance(one_thread):
    steps = 20
    common = dict(epochs=1, max_steps_per_epoch=steps, lr=0.01, dataset="digits", evaluate=False,
                  log=False)
    fp32 = fit(TrainConfig(amp="off", **common))
    bf16 = fit(TrainConfig(amp="bf16", **common))
    gaps = [abs(a - b) for a, b in zip(fp32.step_losses, bf16.step_losses)]
    assert len(gaps) == steps
    assert gaps[0] > 0  # autocast really ran in bfloat16
    # bfloat16 keeps 8 significant bits; after 20 SGD steps the losses still agree to
    # about 0.02. (At lr 0.05 the first steps overshoot to losses above 10, and any
    # rounding difference grows into a different trajectory: no tolerance holds there.)
    assert max(gaps) <= 0.05, gaps
    assert fp32.step_losses[-1] < fp32.step_losses[0] and bf16.step_losses[-1] < bf16.step_losses[0]


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
def test_bench_amp_quick_reports_both_precisions(tmp_path, capsys):
    from ddpguide.bench.__main__ import main

    assert main(["amp", "--quick", "--json", str(tmp_path / "amp.json")]) == 0
    report = json.loads((tmp_path / "amp.json").read_text())
    assert report["suite"] == "amp"
    names = {m["name"] for m in report["measurements"]}
    assert {"fp32 step", "bf16 step", "fp32 activations", "bf16 activations"} <= names
    assert report["ratios"]["bf16_over_fp32_time"] > 0
    assert 0.5 < report["ratios"]["bf16_over_fp32_memory"] < 0.75  # deterministic, not timed
    assert "bf16_over_fp32_time" in capsys.readouterr().out
