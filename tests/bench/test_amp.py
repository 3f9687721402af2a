"""``python -m ddpguide.bench amp``: which precisions it times, and the report it builds.

(Named apart from tests/train/test_amp.py: basenames are unique.) The full
measurement takes tens of seconds on a busy CPU; here the report is built from
a made-up measurement, and one real training step runs per precision.
"""

from __future__ import annotations

import pytest
import torch

from ddpguide.bench import amp as amp_bench
from ddpguide.train.amp import resolve_amp

MIB = 2 ** 20


def test_cpu_times_fp32_and_bf16_and_gpus_add_fp16(monkeypatch):
    assert amp_bench._modes("cpu") == ["off", "bf16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert amp_bench._modes("cuda") == ["off", "bf16", "fp16"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert amp_bench._modes("cuda") == ["off", "fp16"]


@pytest.mark.parametrize("mode", ["off", "bf16"])
def test_one_step_of_each_precision_trains_the_same_model(mode):
    trainer = amp_bench._Trainer(resolve_amp(mode, "cpu"), torch.device("cpu"), width=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    reference = amp_bench._Trainer(resolve_amp("off", "cpu"), torch.device("cpu"), width=2)
    assert all(torch.equal(a, b) for a, b in zip(before, reference.model.parameters()))
    generator = torch.Generator().manual_seed(0)
    trainer.step(torch.rand(4, 1, 28, 28, generator=generator), torch.tensor([0, 1, 2, 3]))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("quick, env", [(True, None), (False, amp_bench.MALLOC_ENV)])
def test_the_report_gives_medians_and_ratios(monkeypatch, quick, env):
    measured = {"device": "cpu", "batch": 256, "width": 16, "threads": 1, "modes": {
        "off": {"times": [0.030, 0.010, 0.020], "activations": 40 * MIB},
        "bf16": {"times": [0.012, 0.014, 0.016], "activations": 22 * MIB}}}
    calls = []

    def fake_spawn(fn, world_size, *args, **kwargs):
        calls.append((fn, world_size, args, kwargs["env"]))
        return [measured]

    monkeypatch.setattr(amp_bench, "spawn", fake_spawn)
    report = amp_bench.run(quick=quick)
    assert calls == [(amp_bench.measure, 1, (quick,), env)]  # quick: forked warm
    assert [(m.name, m.value, m.unit) for m in report.measurements] == [
        ("fp32 step", 20.0, "ms"), ("bf16 step", 14.0, "ms"),
        ("fp32 activations", 40.0, "MiB"), ("bf16 activations", 22.0, "MiB")]
    assert report.get("bf16 step").details["repeats"] == 3
    assert report.ratios == pytest.approx({"bf16_over_fp32_time": 0.7,
                                           "bf16_over_fp32_memory": 0.55})
    assert any("float16 is not timed on CPU" in note for note in report.notes)
