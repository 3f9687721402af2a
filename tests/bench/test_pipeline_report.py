"""Reading a pipeline run: rows, stage times, the sweep plot and the seed's table, from
synthetic measurements (the numbers are made up; what is done with them is not)."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from ddpguide.bench.pipeline_cases import BALANCED, Case  # noqa: E402
from ddpguide.bench.pipeline_report import (  # noqa: E402
    pipeline_rows,
    plot_sweep,
    seed_table,
    stage_times,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _measured(balanced: str) -> dict:
    return {"balanced": balanced, "seconds": {
        Case("single"): 1.0,
        Case("pipeline", "1f1b", 16): 0.7,
        Case("pipeline", "1f1b", 32): 0.6,
        Case("pipeline", "gpipe", 16): 0.75,
        Case("pipeline", "1f1b", 16, BALANCED): 0.55,
    }}


def test_rows_resolve_the_balanced_split_and_leave_out_the_baselines():
    assert pipeline_rows(_measured("layer2.3")) == [
        {"schedule": "1f1b", "split_size": 16, "split_point": "layer3.0", "seconds": 0.7},
        {"schedule": "1f1b", "split_size": 32, "split_point": "layer3.0", "seconds": 0.6},
        {"schedule": "gpipe", "split_size": 16, "split_point": "layer3.0", "seconds": 0.75},
        {"schedule": "1f1b", "split_size": 16, "split_point": "layer2.3", "seconds": 0.55},
    ]


def test_a_balanced_split_at_the_seed_cut_is_one_row():
    rows = pipeline_rows(_measured("layer3.0"))
    assert [(r["schedule"], r["split_size"], r["split_point"]) for r in rows] == [
        ("1f1b", 16, "layer3.0"), ("1f1b", 32, "layer3.0"), ("gpipe", 16, "layer3.0")]


def test_stage_times_add_the_blocks_on_each_side_of_the_cut():
    assert stage_times([1.0, 2.0, 3.0, 4.0], 1) == (1.0, 9.0)
    assert stage_times([1.0, 2.0, 3.0, 4.0], 3) == (6.0, 4.0)


def test_the_sweep_plot_has_a_line_per_schedule_and_split_and_the_baselines(tmp_path):
    rows = pipeline_rows(_measured("layer2.3"))
    path = tmp_path / "plots" / "sweep.png"
    fig = plot_sweep(rows, {"single": 1.0, "threads2": 0.6}, "ResNet50 test", str(path))
    (ax,) = fig.axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines == {
        "pipeline 1f1b, stage 1 from layer2.3": ([16], [0.55]),
        "pipeline 1f1b, stage 1 from layer3.0": ([16, 32], [0.7, 0.6]),
        "pipeline gpipe, stage 1 from layer3.0": ([16], [0.75]),
        "1 process x 1 thread": ([0, 1], [1.0, 1.0]),
        "1 process x 2 threads": ([0, 1], [0.6, 0.6]),
        "2 cores, perfectly used": ([0, 1], [0.5, 0.5]),
    }
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32"]
    assert (ax.get_xlabel(), ax.get_title()) == ("micro-batch size (split_size)", "ResNet50 test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_seed_table_sets_this_machine_beside_the_seed():
    lines = seed_table(0.2, 0.25, {"seconds": 0.1, "split_size": 16},
                       {"seconds": 0.08, "split_size": 32, "split_point": "layer2.3"})
    assert lines[0].endswith("this machine: CPU processes")
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "one device", "model parallel", "pipelined", "pipelined, best"]
    assert lines[1].rstrip().endswith("200 ms (1 process x 1 thread)")
    assert lines[2].endswith("250 ms (1.25x time)")
    assert lines[3].endswith("100 ms (2.00x, seed split, micro-batch 16)")
    assert lines[4].endswith("80 ms (2.50x, stage 1 from layer2.3, micro-batch 32)")
    assert "3.75 s" in lines[1] and "4.02 s (1.07x time)" in lines[2]
