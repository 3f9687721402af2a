"""``python -m ddpguide.bench compile``: the report it builds from the worker's timings.

The worker compiles a ConvNet (minutes on a busy 2-core machine); here it is replaced by
made-up timings, so the test checks what the suite computes from them, and its progress.
"""

from __future__ import annotations

import statistics

import pytest

from ddpguide.bench import compile as compile_bench


@pytest.mark.parametrize("quick", [True, False])
def test_the_ratio_is_the_median_of_per_round_ratios_and_every_case_is_counted(monkeypatch, quick):
    rounds, warmup = compile_bench._rounds(quick)
    eager = [0.010 + 0.001 * r for r in range(rounds)]
    compiled = [0.5 * t for t in eager]
    compiled[0] = 0.040  # one noisy round: the median ignores it
    calls, progresses = [], []

    def fake_spawn(fn, world_size, *args, **kwargs):
        calls.append((fn, world_size, args))
        progress = progresses[0]
        for name in ("eager", "compiled"):
            progress.advance(f"{name}: warm-up")
        for r in range(rounds):
            progress.advance(f"round {r + 1} of {rounds}")
        return [{"device": "cpu", "threads": 1, "eager_warmup": 0.03, "compiled_warmup": 25.0,
                 "times": {"eager": eager, "compiled": compiled}}]

    real_tracked = compile_bench.tracked

    def tracked(report, total, **kwargs):
        progresses.append(real_tracked(report, total, **kwargs))
        return progresses[-1]

    monkeypatch.setattr(compile_bench, "spawn", fake_spawn)
    monkeypatch.setattr(compile_bench, "tracked", tracked)
    report = compile_bench.run(quick=quick)
    assert calls == [(compile_bench.measure, 1, (quick,))]  # one rank, in a fresh process
    assert progresses[0].done == progresses[0].total == 2 + rounds
    assert report.ratios["compiled_over_eager_time"] == pytest.approx(0.5)
    assert report.spreads["compiled_over_eager_time"]["n"] == rounds
    assert report.get("DDP compiled: step").value == pytest.approx(1e3 * statistics.median(compiled))
    assert report.get(f"DDP compiled: first {warmup} steps").value == 25.0
