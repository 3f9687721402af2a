"""PyTorch's context_parallel on CPU: the program stops with the library's error, in one line."""

from __future__ import annotations

import pytest

from ddpguide.launch.programs import run, torchrun

ERROR = ("context_parallel on cpu: NotImplementedError: Operator "
         "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
         "strategy registered.")


@pytest.mark.timeout(300)
def test_context_parallel_fails_on_cpu_with_the_kernel_it_has_no_rule_for():
    launch = run("context_parallel_torch.py", launcher=torchrun(2), timeout=240, expect=None,
                 echo=False)
    assert launch.returncode != 0, launch.text()
    assert ERROR in launch.program_lines(), launch.text()
