"""The cluster chapter's formulas: the fit recovers a known line, bytes and times by hand."""

from __future__ import annotations

import pytest

from ddpguide.cluster import model


def test_alpha_beta_fit_recovers_the_line():
    alpha, beta = 0.003, 6.25e6
    points = [(n, alpha + n / beta) for n in (2**20, 2**21, 2**22, 2**23)]
    fitted = model.fit_alpha_beta(points)
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)
    with pytest.raises(ValueError, match="at least two sizes"):
        model.fit_alpha_beta([(1, 1.0), (1, 2.0)])


def test_bytes_per_node_of_each_collective():
    n = 8 * 2**20
    assert model.ring_all_reduce_bytes(n, 4) == 1.5 * n
    assert model.ring_all_gather_bytes(n, 4) == 0.75 * n
    assert model.hierarchical_bytes(n, 2) == n
    assert model.fsdp_step_bytes(n, 4) == 3 * n  # 2 x 0.75 + 1.5
    assert model.hsdp_step_bytes(n, 2) == n


def test_hierarchical_time_against_flat_by_hand():
    n, alpha, beta = 8e6, 0.0, 1e6
    assert model.flat_time(n, 4, alpha, beta) == pytest.approx(6 * 2.0)  # 6 steps of N/4
    # inside: 2 steps of N/2 at 100x the speed; across: 2 steps of N/2 on the link
    assert model.hierarchical_time(n, 2, 2, alpha, beta, 0.0, 1e8) == pytest.approx(0.08 + 8.0)


def test_exposed_prediction_one_bucket_is_the_whole_all_reduce():
    # the buckets all-reduced alone take 0.4 s; backward 0.4 s after a 0.1 s forward
    run = {"forward_seconds": 0.1, "compute_seconds": 0.5, "comm_seconds": 0.4, "buckets": [1000]}
    assert model.exposed_prediction(run) == pytest.approx(
        {"bucketed": 0.4, "simple": 0.0, "comm": 0.4})
    run["buckets"] = [250] * 4  # ready at 0.2, 0.3, 0.4, 0.5; each takes 0.1 on the link
    assert model.exposed_prediction(run)["bucketed"] == pytest.approx(0.6 - 0.5)
