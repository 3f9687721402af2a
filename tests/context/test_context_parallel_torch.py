"""PyTorch's context_parallel on CPU: the program stops with the library's error, in one line."""

from __future__ import annotations

import pytest

from ddpguide.launch.programs import run, torchrun

ERROR = ("context_parallel on cpu: NotImplementedError: Operator "
         "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
         "strategy registered.")


@pytest.mark.timeout(300)
def test_context_parallel_fails_on_cpu_with_the_kernel_it_has_no_rule_for(tmp_path):
    launch = run("context_parallel_torch.py", launcher=torchrun(2), timeout=240, expect=None,
                 echo=False, workdir=tmp_path)
    assert launch.returncode != 0, launch.text()
    assert ERROR in launch.program_lines(), launch.text()


@pytest.mark.parametrize("worst, dtype, ok", [
    ([4e-3, 8e-3, 1.5e-2, 2e-2], "bfloat16", True),
    ([4e-3, 8e-3, 3e-2, 1e-3], "bfloat16", False),  # one gradient beyond it: the run fails
    ([1e-15, 2e-15, 1e-15, 1e-15], "float64", True),
    ([1e-15, 2e-15, 1e-6, 1e-15], "float64", False),
])
def test_the_comparison_on_gpus_fails_beyond_its_stated_tolerance(worst, dtype, ok):
    import torch

    from ddpguide.launch.programs import load

    program = load("context_parallel_torch.py")
    assert program.TOLERANCE == {torch.bfloat16: 2e-2, torch.float64: 1e-10}
    assert program.within_tolerance(worst, getattr(torch, dtype)) is ok


def test_the_tolerance_is_relative_to_the_largest_value():
    """A bfloat16 ulp grows with the value: two ulps at 3.33 (0.031) are rounding, while the
    same difference on values of order 1 is not."""
    import torch

    from ddpguide.launch.programs import load

    program = load("context_parallel_torch.py")
    large = torch.tensor([3.33, -1.0, 0.5])
    small = torch.tensor([1.0, -0.5, 0.25])
    assert program.within_tolerance([program.scaled_difference(large + 0.031, large)], torch.bfloat16)
    assert not program.within_tolerance([program.scaled_difference(small + 0.031, small)], torch.bfloat16)
