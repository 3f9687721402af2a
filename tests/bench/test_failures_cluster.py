"""The cluster's side of chapter 17's recovery: torchrun's loss read like torchft's."""

from __future__ import annotations

import pytest

from ddpguide.bench import failures, failures_cluster


def _timeline(after: list[float]) -> dict:
    epochs = [{"t": t, "event": "epoch", "world_size": 2} for t in (1.0, 1.5, 2.0, 2.5)]
    epochs += [{"t": t, "event": "epoch", "world_size": 1} for t in after]
    return {"timeline": [*epochs[:3], {"t": 2.2, "event": "link down", "node": 1}, *epochs[3:]]}


def test_torchrun_loses_the_gap_from_its_last_epoch_before_the_cut_less_one_epoch():
    # 2.5 was logged after the cut but by the old world: an epoch whose all-reduces were done
    assert failures_cluster.torchrun_lost_s(_timeline([14.0, 14.5])) == pytest.approx(14.0 - 2.0 - 0.5)
    with pytest.raises(RuntimeError, match="no epoch on both sides of the link loss"):
        failures_cluster.torchrun_lost_s(_timeline([]))    # the survivors never came back


def test_the_cluster_ratios_are_anchored_in_the_failures_suite():
    for name in failures_cluster.ANCHORS:
        assert failures.ANCHORS[name] == failures_cluster.ANCHORS[name]


def test_p_is_the_median_of_the_probes_before_and_after_a_failure():
    assert failures.probed_start_s({"start_s": 3.0, "start_after_s": 5.0}) == 4.0
    assert failures.probed_start_s({"start_s": 3.0}) == 3.0   # the run ended before the second
