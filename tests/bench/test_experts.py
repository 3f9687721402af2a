"""``python -m ddpguide.bench experts --quick``: the named ratios, the bytes counted exactly."""

from __future__ import annotations

import json
import math

import pytest

from ddpguide.bench.appendix import ANCHORS

RATIOS = ("alltoall_bytes_over_formula", "ep2_tokens_per_s_over_single",
          "hot_expert_step_over_balanced")


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_quick_mode_reports_the_named_ratios(tmp_path, capsys):
    from ddpguide.bench.__main__ import main

    assert main(["experts", "--quick", "--json", str(tmp_path / "experts.json")]) == 0
    report = json.loads((tmp_path / "experts.json").read_text())
    assert report["suite"] == "experts"
    ratios = report["ratios"]
    assert tuple(ratios) == RATIOS
    assert set(RATIOS) == set(ANCHORS["experts"])  # each ratio beside its anchor in the appendix
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    # counted, not timed: 256 tokens x 64 x 8 B x 2 x 1/2, plus the counts (2 x 8 B)
    assert ratios["alltoall_bytes_over_formula"] == (256 * 64 * 8 + 16) / (256 * 64 * 8)
    hot = next(m for m in report["measurements"] if m["name"].endswith("one hot expert: step"))
    assert hot["details"]["tokens_per_expert"][0] == 2 * 256  # every token chose expert 0
    out = capsys.readouterr().out
    assert "all-to-all bytes per rank, 2 ranks: 131088 B counted, 131072 B by the formula" in out
    assert "hot_expert_step_over_balanced" in out
