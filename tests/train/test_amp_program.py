"""Mixed precision on the chapter's own model: the ConvNet of ``amp_ddp.py``, loaded by path.

The dtypes and the memory follow the program: an edited copy changes them.
"""

from __future__ import annotations

import torch

from ddpguide.launch import programs
from ddpguide.train import amp_program
from tests.edited_programs import edited_copy


def _edited(tmp_path, *edits: tuple[str, str]) -> str:
    return str(edited_copy(amp_program.PROGRAM, tmp_path, *edits))


def test_the_images_are_the_programs_digits():
    train, test = programs.load(amp_program.PROGRAM).digits_splits()
    assert tuple(test[0][0].shape) == tuple(train[0][0].shape) == amp_program.IMAGE


def test_the_model_is_the_programs_and_runs_in_bfloat16_under_autocast():
    model = amp_program.convnet()
    assert type(model).__module__ == "program_amp_ddp"
    assert torch.equal(next(model.parameters()), next(amp_program.convnet().parameters()))
    layers = amp_program.layer_dtypes("bf16")
    assert [name for name, _, _ in layers] == [f"features.{i}" for i in range(8)] + ["head"]
    assert {dtype for _, _, dtype in layers} == {torch.bfloat16}
    assert {dtype for _, _, dtype in amp_program.layer_dtypes("off")} == {torch.float32}


def test_bfloat16_halves_each_images_floating_point_activations_but_not_the_indices():
    """Per image (the difference of two batches), exactly: every floating-point activation
    halves but the loss's log-softmax (10 classes), which autocast keeps in float32."""
    small, large = amp_program.activation_memory(64), amp_program.activation_memory(128)
    fp32, bf16 = ({dtype: large[mode][dtype] - small[mode][dtype] for dtype in large[mode]}
                  for mode in ("off", "bf16"))
    assert bf16[torch.float32] == 64 * 10 * 4
    assert fp32[torch.float32] == 2 * bf16[torch.bfloat16] + bf16[torch.float32]
    # int64: the max-pool indices (16 maps of 4x4, 32 of 2x2) and the label, in both modes
    assert bf16[torch.int64] == fp32[torch.int64] == 64 * (16 * 4 * 4 + 32 * 2 * 2 + 1) * 8
    # what does not grow with the batch: bfloat16 copies of weights, kept for backward
    assert 0 < 2 * small["bf16"][torch.bfloat16] - small["off"][torch.float32] < 2 ** 16


def test_the_checks_follow_the_program(tmp_path):
    """A reader doubles the first convolution's channels: the counts change with the program."""
    wider = _edited(tmp_path, ("nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16)",
                               "nn.Conv2d(1, 32, 5, padding=2), nn.BatchNorm2d(32)"),
                    ("nn.Conv2d(16, 32, 5, padding=2)", "nn.Conv2d(32, 32, 5, padding=2)"))
    plain = amp_program.activation_memory(8, modes=("off",))["off"]
    edited = amp_program.activation_memory(8, modes=("off",), program=wider)["off"]
    assert edited[torch.int64] == plain[torch.int64] + 8 * 16 * 4 * 4 * 8  # 16 more pooled maps
    assert edited[torch.float32] > plain[torch.float32]
    assert amp_program.convnet(wider).features[0].out_channels == 32
