"""dtensor_regression.py: the source's regression as SBP, boxing by hand, a tensor-parallel layer."""

from __future__ import annotations

import pytest

from tests.programs.programs_support import TORCHRUN, check_ok, copy_program, run


@pytest.mark.timeout(300)
def test_the_regression_the_boxing_and_the_layer_check_out(tmp_path):
    copy_program("dtensor_regression.py", tmp_path)
    out = check_ok(run([TORCHRUN, "--standalone", "--nproc-per-node=4", "dtensor_regression.py"],
                       tmp_path, timeout=240)).stdout
    assert out.count("check passed:") == 1 and "FAILED" not in out
    assert [line.split(" loss:")[0] for line in out.splitlines() if " loss:" in line] == [
        f"{step}/500" for step in range(50, 501, 50)]
    assert "prediction (Shard(dim=0),), loss (Partial(sum),), gradient (Partial(sum),)" in out
    assert "collectives: forward + backward none, optimizer.step() {'all_reduce': 1}" in out
    for rule in ("S(0) -> B: all_gather", "P -> B: all_reduce", "P -> S(0): reduce_scatter",
                 "S(0) -> S(1): all_to_all"):
        assert f"by hand {rule:28s} equals DTensor's redistribute: True" in out, rule
    assert "0.weight  placements (Shard(dim=0),), local shape (4, 8)" in out
    assert "2.weight  placements (Shard(dim=1),), local shape (8, 4)" in out
    assert "collectives: forward {'all_reduce': 1}, backward none" in out
