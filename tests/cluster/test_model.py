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


def test_nccl_reduce_scatters_half_of_gloo_s_bytes():
    n = 8 * 2**20
    assert model.reduce_scatter_bytes(n, 4) == 1.5 * n  # gloo: an all-reduce
    assert model.reduce_scatter_bytes(n, 4, "nccl") == 0.75 * n
    assert model.fsdp_step_bytes(n, 4, "nccl") == 2.25 * n
    with pytest.raises(ValueError, match="no reduce-scatter formula for backend 'mpi'"):
        model.reduce_scatter_bytes(n, 4, "mpi")


def test_hierarchical_time_against_flat_by_hand():
    n, alpha, beta = 8e6, 0.0, 1e6
    assert model.flat_time(n, 4, alpha, beta) == pytest.approx(6 * 2.0)  # 6 steps of N/4
    # inside on gloo: 3 steps of N/2 at 100x the speed (its reduce-scatter is an all-reduce,
    # then the all-gather); across: 2 steps of N/2 on the link
    assert model.hierarchical_time(n, 2, 2, alpha, beta, 0.0, 1e8) == pytest.approx(0.12 + 8.0)
    assert model.hierarchical_time(n, 2, 2, alpha, beta, 0.0, 1e8, "nccl") == pytest.approx(0.08 + 8.0)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        model.hierarchical_time(n, 2, 2, alpha, beta, 0.0, 1e8, "mpi")
    # a latency is paid once a step: 6 steps
    assert model.flat_time(n, 4, 1e-3, beta) == pytest.approx(6 * (2.0 + 1e-3))


def test_a_token_bucket_s_sweep_crosses_zero_at_minus_its_burst():
    burst, rate = 64 * 1024, 6.25e6
    points = [(n, (n - burst) / rate) for n in (2**20, 2**21, 2**22, 2**23)]
    intercept, beta = model.fit_alpha_beta(points)
    assert beta == pytest.approx(rate)
    assert intercept == pytest.approx(model.burst_intercept(burst, rate)) == pytest.approx(-0.01048576)


def test_exposed_prediction_one_bucket_is_the_whole_all_reduce():
    # the buckets all-reduced alone take 0.4 s; backward 0.4 s after a 0.1 s forward
    run = {"forward_seconds": 0.1, "compute_seconds": 0.5, "comm_seconds": 0.4, "buckets": [1000]}
    assert model.exposed_prediction(run) == pytest.approx(
        {"bucketed": 0.4, "simple": 0.0, "comm": 0.4})
    run["buckets"] = [250] * 4  # ready at 0.2, 0.3, 0.4, 0.5; each takes 0.1 on the link
    assert model.exposed_prediction(run)["bucketed"] == pytest.approx(0.6 - 0.5)


def _collectives_result(intercept: float, latency: float) -> dict:
    """A collectives.py report of a 2 x 2 cluster on a 50 Mbit/s link whose sweep has the
    given intercept; bytes and times as the formulas say."""
    rate = 50e6 / 8 * 0.956
    sweep = [{"bytes": n, "seconds": intercept + n / rate} for n in (2**20, 2**21, 2**22)]
    inside = [{"bytes": n, "seconds": n / 2e9} for n in (2**20, 2**21, 2**22)]
    n_bytes = 2**21 * 4
    phase = {"seconds": 2.0, "payload_per_node": [int(1.5 * n_bytes)] * 2}
    return {"world": 4, "nodes": 2, "local_world": 2, "numel": 2**21, "element_bytes": 4,
            "latency": {"across": latency, "inside": latency / 2}, "sweep": sweep,
            "intra_sweep": inside, "same_sum": True, "barrier": {"payload_per_node": [0, 0]},
            **{name: phase for name in ("flat", "hierarchical", "all_gather", "reduce_scatter")}}


def test_the_bench_takes_latency_from_the_ping_pong_and_holds_the_intercept_to_the_burst():
    from ddpguide.bench import cluster as suite
    from ddpguide.bench.report import Report

    report = Report("cluster")
    suite.add_collectives(report, _collectives_result(-0.0105, 50e-6), 50_000_000)
    ratios = report.ratios
    assert 0.95 <= ratios["link_intercept_over_burst"] <= 1.05
    flat = next(m for m in report.measurements if m.name == "flat_seconds")
    beta = 50e6 / 8 * 0.956
    assert flat.details["predicted"] == pytest.approx(model.flat_time(2**21 * 4, 4, 50e-6, beta))
    latency = next(m for m in report.measurements if m.name == "link_latency")
    assert latency.value == pytest.approx(50.0) and latency.details["inside_node_us"] == pytest.approx(25.0)
    # an intercept that is not the bucket's (a latency of 10 ms, say) fails the band
    planted = Report("cluster")
    suite.add_collectives(planted, _collectives_result(+0.0105, 50e-6), 50_000_000)
    assert not 0.8 <= planted.ratios["link_intercept_over_burst"] <= 1.25
