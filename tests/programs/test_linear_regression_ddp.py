"""linear_regression_ddp.py: w reaches [2, 3]; with a sum loss DDP steps 1/world_size as far."""

from __future__ import annotations

import pytest
import torch

from ddpguide.launch import report
from tests.programs.programs_support import PYTHON, check_ok, copy_program, load_program, run


def one_process_first_step(program, loss: str, lr: float) -> torch.Tensor:
    """w after one SGD step from 0 on the whole batch, by hand: w - lr * dL/dw."""
    x, y = program.make_data()
    x, y = x.double(), y.double()
    gradient = 2 * x.T @ (x @ torch.zeros(2, 1, dtype=torch.float64) - y)  # of the sum loss
    if loss == "mean":
        gradient /= len(x)
    return (-lr * gradient).flatten()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("loss, factor", [("mean", 1.0), ("sum", 0.5)])
def test_ddp_reaches_2_3_and_its_first_step_is_the_predicted_fraction(tmp_path, loss, factor):
    path = copy_program("linear_regression_ddp.py", tmp_path)
    command = [PYTHON, "linear_regression_ddp.py", "--report", "report.json"]  # mean: its Run: line
    result = check_ok(run(command + (["--loss", "sum"] if loss == "sum" else []), tmp_path,
                          timeout=120))
    out = report.read(tmp_path / "report.json")
    assert out["world_size"] == 2 and out["loss"] == loss
    torch.testing.assert_close(torch.tensor(out["ddp"][-1]), torch.tensor([2.0, 3.0]),
                               rtol=0, atol=1e-2)
    one_step = one_process_first_step(load_program(path), loss, out["lr"])
    ddp_step = torch.tensor(out["ddp"][1], dtype=torch.float64)  # from w = [0, 0]
    torch.testing.assert_close(ddp_step / one_step, torch.full((2,), factor, dtype=torch.float64),
                               rtol=0, atol=1e-6)
    assert f"effective learning rate {out['lr'] * factor:g}" in result.stdout
