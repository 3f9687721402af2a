"""Reading a pipeline run: rows, stage times, the sweep plot and the source's table, from
synthetic measurements (the numbers are made up; what is done with them is not)."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from ddpguide.bench.pipeline_report import (  # noqa: E402
    seed_table,
    stage_times,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_stage_times_add_the_blocks_on_each_side_of_the_cut():
    assert stage_times([1.0, 2.0, 3.0, 4.0], 1) == (1.0, 9.0)
    assert stage_times([1.0, 2.0, 3.0, 4.0], 3) == (6.0, 4.0)


def test_the_seed_table_sets_this_machine_beside_the_seed():
    lines = seed_table(0.2, 0.25, {"seconds": 0.1, "split_size": 16},
                       {"seconds": 0.08, "split_size": 32, "split_point": "layer2.3"})
    assert lines[0].endswith("this machine: CPU processes")
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "one device", "model parallel", "pipelined", "pipelined, best"]
    assert lines[1].rstrip().endswith("200 ms (1 process x 1 thread)")
    assert lines[2].endswith("250 ms (1.25x time)")
    assert lines[3].endswith("100 ms (2.00x, source's split, micro-batch 16)")
    assert lines[4].endswith("80 ms (2.50x, stage 1 from layer2.3, micro-batch 32)")
    assert "3.75 s" in lines[1] and "4.02 s (1.07x time)" in lines[2]
