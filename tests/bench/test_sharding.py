"""``python -m ddpguide.bench sharding --quick``: the named ratios, from real measurements."""

from __future__ import annotations

import json
import math

import pytest

RATIOS = ("fsdp_state_over_ddp_4ranks", "fsdp_peak_over_ddp_4ranks", "zero1_state_over_ddp_4ranks",
          "fsdp_step_over_ddp_2ranks", "hand_zero3_over_fsdp_2ranks")


@pytest.mark.timeout(1200)
@pytest.mark.multiprocess
def test_quick_mode_reports_the_named_ratios(tmp_path, capsys):
    from ddpguide.bench import sharding
    from ddpguide.bench.__main__ import main

    assert main(["sharding", "--quick", "--json", str(tmp_path / "sharding.json")]) == 0
    report = json.loads((tmp_path / "sharding.json").read_text())
    assert report["suite"] == "sharding"
    ratios = report["ratios"]
    assert tuple(ratios) == RATIOS
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    # counted bytes, not timed: FSDP2 keeps 1/4 of DDP's model state on 4 ranks (plus Adam's
    # 4-byte step counters); ZeRO-1 divides only the optimizer state, by whole tensors
    assert abs(ratios["fsdp_state_over_ddp_4ranks"] - 0.25) < 1e-4
    assert 0.625 <= ratios["zero1_state_over_ddp_4ranks"] <= 0.75
    assert ratios["fsdp_peak_over_ddp_4ranks"] < 1.0
    names = [m["name"] for m in report["measurements"]]
    for label, world in (("DDP", 2), ("ZeRO-1", 2), ("FSDP2", 2), ("ZeRO-3 by hand", 2),
                         ("DDP", 4), ("ZeRO-1", 4), ("FSDP2", 4)):
        for what in ("state per rank", "peak of one step", "step"):
            assert f"{label}, {world} ranks: {what}" in names
    width, layers = sharding.QUICK_MLP
    assert report["measurements"][0]["details"]["parameters"] == layers * (width * width + width)
    assert "fsdp_step_over_ddp_2ranks" in capsys.readouterr().out
