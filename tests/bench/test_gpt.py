"""``python -m ddpguide.bench gpt --quick``: the named ratios, each beside its anchor, and the
bytes counted equal to the prediction on every layout."""

from __future__ import annotations

import json
import math

import pytest

from ddpguide.bench.appendix import ANCHORS
from ddpguide.bench.gpt import LAYOUTS, _key

RATIOS = ("mfu_one_process", *(f"step_time_predicted_over_measured_{_key(name)}"
                               for name, _, _ in LAYOUTS[1:]),
          "bytes_counted_over_predicted", "activation_checkpoint_peak_over_plain",
          "compile_step_over_eager")


def test_layout_keys_are_the_appendix_names():
    assert [_key(name) for name, _, _ in LAYOUTS] == ["1_process", "fsdp2_2", "tp_2", "pp_2"]
    assert _key("FSDP x TP 2 x 2") == "fsdp_x_tp_2_x_2"


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_quick_mode_reports_the_named_ratios(tmp_path, capsys):
    from ddpguide.bench.__main__ import main

    assert main(["gpt", "--quick", "--json", str(tmp_path / "gpt.json")]) == 0
    report = json.loads((tmp_path / "gpt.json").read_text())
    assert report["suite"] == "gpt"
    ratios = report["ratios"]
    assert tuple(ratios) == RATIOS
    assert set(RATIOS) <= set(ANCHORS["gpt"])  # each ratio beside its anchor in the appendix
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    assert ratios["bytes_counted_over_predicted"] == 1.0  # counted, not timed: exact
    assert 0 < ratios["mfu_one_process"] < 1
    assert "bytes_counted_over_predicted: 1.0000 (worst kind 1.0000)" in capsys.readouterr().out
