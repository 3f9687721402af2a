"""``python -m ddpguide.bench context --quick``: the named ratios, from real measurements."""

from __future__ import annotations

import json
import math

import pytest

from ddpguide.bench.appendix import ANCHORS

RATIOS = ("ring_over_full_time_2ranks", "ring_peak_over_full_2ranks", "zigzag_busiest_over_mean",
          "contiguous_busiest_over_mean", "zigzag_step_busiest_over_mean", "contiguous_step_busiest_over_mean",
          "ulysses_bytes_over_ring_bytes")


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_quick_mode_reports_the_named_ratios(tmp_path, capsys):
    from ddpguide.bench.__main__ import main

    assert main(["context", "--quick", "--json", str(tmp_path / "context.json")]) == 0
    report = json.loads((tmp_path / "context.json").read_text())
    assert report["suite"] == "context"
    ratios = report["ratios"]
    assert set(ratios) == set(RATIOS)
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    # counted, not timed: bytes are the formula 8(N-1)/N / (6N-4) at N = 4, exactly
    assert ratios["ulysses_bytes_over_ring_bytes"] == pytest.approx(0.3, abs=1e-12)
    # counted live bytes: blocks of (S/2)^2 against S^2 scores
    assert ratios["ring_peak_over_full_2ranks"] <= 0.55
    names = [m["name"] for m in report["measurements"]]
    assert "peak activation memory, 1 process" in names
    assert "causal, zigzag, 2 ranks: block products of rank 1" in names
    assert "causal, contiguous, 2 ranks: forward + backward of rank 1" in names
    assert set(ratios) <= set(ANCHORS["context"])
    out = capsys.readouterr().out
    assert "ring attention, 2 ranks, round 1:" in out  # printed as soon as measured
