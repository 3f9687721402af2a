"""The DDP benchmark suite: what it measures and how it computes its ratios (speed is
measured, never asserted here)."""

from __future__ import annotations

import json

import pytest

from ddpguide.bench.__main__ import main as bench_main
from ddpguide.bench.appendix import ANCHORS
from ddpguide.bench.ddp import (
    DEFINITIONS,
    PROCESS_CASES,
    QUICK,
    combine_ranks,
    pair_time,
    per_round_ratios,
    verdict,
)
from ddpguide.bench.ddp_steps import BOTH_RANKS, VARIANTS, interleave, rotated, supported_variants
from ddpguide.bench.report import Report, spread_of

SPREAD_FIELDS = {"median", "q1", "q3", "min", "max", "n"}
HEADLINE = ["ddp2_over_plain", "independent2_speedup", "ddp2_over_independent2"]
INTERLEAVED = [*HEADLINE, "ddp1_over_plain", "ddp1_over_plain_cpu", "ddp2_speedup"]
PER_PROCESS = ["ddp2_over_plain_separate", "independent2_speedup_separate",
               "ddp1_over_plain_separate", "threads2_speedup", "ddp2_speedup_toy"]


def expected_names(variants: list[str]) -> set[str]:
    options = {f"ddp1_over_plain_{v}" for v in variants if v != "ddp"}
    return {*INTERLEAVED, *PER_PROCESS, *options}


@pytest.mark.timeout(660)
@pytest.mark.multiprocess
def test_quick_mode_reports_every_ratio_with_its_spread(tmp_path):
    assert bench_main(["ddp", "--quick", "--json", str(tmp_path / "ddp.json")]) == 0
    report = json.loads((tmp_path / "ddp.json").read_text())
    variants = supported_variants()
    assert set(report["ratios"]) == expected_names(variants)
    assert list(report["ratios"])[0] == "ddp2_over_plain"  # the headline comes first
    for name, value in report["ratios"].items():
        spread = report["spreads"][name]
        assert set(spread) == SPREAD_FIELDS, name
        assert value == spread["median"] and value > 0, name
        assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"], name
        interleaved = name in INTERLEAVED or name.removeprefix("ddp1_over_plain_") in VARIANTS
        assert spread["n"] == (QUICK.step_rounds if interleaved else QUICK.process_rounds), name
    names = [m["name"] for m in report["measurements"]]
    assert len(names) == len(variants) + 1 + len(BOTH_RANKS) + len(PROCESS_CASES)
    assert all(name.endswith(("(interleaved)", "(separate)")) for name in names)
    convnet = [m["details"]["case"] for m in report["measurements"] if "toy" not in m["name"]]
    assert all(case.startswith(f"ConvNet 28x28, batch {QUICK.batch} per rank,") for case in convnet)
    notes = "\n".join(report["notes"])
    assert notes.startswith("headline: DDP on 2 ranks x 1 thread trains ")
    assert "trusted: the interleaved figures." in notes
    for name in report["ratios"]:  # every ratio is defined in the notes and has an anchor
        assert name in ANCHORS["ddp"], name
        defined = (name if name in DEFINITIONS else "<ratio>_separate" if name.endswith("_separate")
                   else "ddp1_over_plain_<option>")
        assert f"  {defined}: " in notes, name


def test_interleaving_alternates_the_cases_step_by_step():
    order: list[str] = []
    now = [0.0]

    def case(name: str, seconds: float):
        def step() -> None:
            order.append(name)
            now[0] += seconds
        return step

    steps = {"plain": case("plain", 1.0), "ddp": case("ddp", 2.0), "flags": case("flags", 4.0)}
    times = interleave(steps, rounds=4, clocks={"wall": lambda: now[0], "cpu": lambda: now[0] / 2})
    assert order == ["plain", "ddp", "flags", "ddp", "flags", "plain",
                     "flags", "plain", "ddp", "plain", "ddp", "flags"]
    assert times == {"wall": {"plain": [1.0] * 4, "ddp": [2.0] * 4, "flags": [4.0] * 4},
                     "cpu": {"plain": [0.5] * 4, "ddp": [1.0] * 4, "flags": [2.0] * 4}}
    # Two cases: A B, B A, A B: never the same case twice within a round.
    assert [rotated(["A", "B"], r) for r in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]


def fake_timings() -> tuple[dict, dict]:
    steps = {
        "wall": {"plain": [0.1, 0.2, 0.4], "ddp": [0.11, 0.2, 0.3], "static_graph": [0.1, 0.3, 0.4],
                 "independent": [0.125, 0.25, 0.5], "ddp2": [0.125, 0.4, 0.5]},
        "cpu": {"plain": [0.1, 0.2, 0.4], "ddp": [0.1, 0.25, 0.5], "static_graph": [0.1, 0.2, 0.4],
                "independent": [0.1, 0.2, 0.4], "ddp2": [0.1, 0.2, 0.4]},
    }
    processes = {
        "plain": [1.0, 2.0], "ddp1": [1.1, 2.4], "ddp2": [1.25, 2.5], "independent": [1.2, 2.25],
        "threads2": [0.6, 1.0], "toy1": [1e-4, 2e-4], "toy2": [4e-4, 5e-4],
    }
    return steps, processes


def test_ddp_pairs_take_the_slower_rank_and_independent_pairs_add_their_rates():
    assert pair_time("ddp2", [0.2, 0.3]) == 0.3
    assert pair_time("toy2", [0.2, 0.3]) == 0.3
    assert pair_time("independent", [0.2, 0.3]) == pytest.approx(0.24)  # 5 + 3.33 steps/s
    rank0 = {"times": {"wall": {"plain": [1.0, 2.0], "ddp": [1.5, 2.5], "independent": [3.0, 1.0],
                                "ddp2": [2.0, 2.0]}, "cpu": {"plain": [1.0, 1.0], "ddp": [1.0, 1.0],
                                "independent": [1.0, 1.0], "ddp2": [1.0, 1.0]}}}
    rank1 = {"times": {"wall": {"plain": [0.0, 0.0], "ddp": [0.0, 0.0], "independent": [6.0, 1.0],
                                "ddp2": [2.5, 1.5]}, "cpu": {"plain": [0.0, 0.0], "ddp": [0.0, 0.0],
                                "independent": [1.0, 3.0], "ddp2": [0.5, 3.0]}}}
    assert combine_ranks([rank0, rank1]) == {
        "wall": {"plain": [1.0, 2.0], "ddp": [1.5, 2.5], "independent": [4.0, 1.0], "ddp2": [2.5, 2.0]},
        "cpu": {"plain": [1.0, 1.0], "ddp": [1.0, 1.0], "independent": [1.0, 1.5], "ddp2": [1.0, 3.0]},
    }


def test_each_ratio_is_computed_per_round_as_defined():
    steps, p = fake_timings()
    ratios = per_round_ratios(steps, p)
    w, c = steps["wall"], steps["cpu"]
    expected = {
        "ddp2_over_plain": [2 * w["plain"][i] / w["ddp2"][i] for i in range(3)],
        "independent2_speedup": [2 * w["plain"][i] / w["independent"][i] for i in range(3)],
        "ddp2_over_independent2": [w["independent"][i] / w["ddp2"][i] for i in range(3)],
        "ddp1_over_plain": [w["ddp"][i] / w["plain"][i] for i in range(3)],
        "ddp1_over_plain_cpu": [c["ddp"][i] / c["plain"][i] for i in range(3)],
        "ddp1_over_plain_static_graph": [w["static_graph"][i] / w["plain"][i] for i in range(3)],
        "ddp2_speedup": [2 * w["ddp"][i] / w["ddp2"][i] for i in range(3)],
        "ddp2_over_plain_separate": [2 * p["plain"][r] / p["ddp2"][r] for r in range(2)],
        "independent2_speedup_separate": [2 * p["plain"][r] / p["independent"][r] for r in range(2)],
        "ddp1_over_plain_separate": [p["ddp1"][r] / p["plain"][r] for r in range(2)],
        "threads2_speedup": [p["plain"][r] / p["threads2"][r] for r in range(2)],
        "ddp2_speedup_toy": [2 * p["toy1"][r] / p["toy2"][r] for r in range(2)],
    }
    assert list(ratios) == list(expected)
    for name, values in expected.items():
        assert ratios[name] == pytest.approx(values, rel=1e-12), name
    # Worked by hand: the headline is 1.6, 1.0, 1.6; the bound 1.6 in every round.
    assert ratios["ddp2_over_plain"] == pytest.approx([1.6, 1.0, 1.6])
    assert ratios["independent2_speedup"] == pytest.approx([1.6, 1.6, 1.6])
    assert ratios["ddp1_over_plain"] == pytest.approx([1.1, 1.0, 0.75])
    assert ratios["ddp2_over_plain_separate"] == pytest.approx([1.6, 1.6])


def test_a_ratio_is_the_median_of_its_rounds_with_quartiles_and_range():
    report = Report("ddp", machine={})
    assert report.add_ratio("r", [1.5, 1.0, 5.0, 2.0, 3.0]) == 2.0
    assert report.spreads["r"] == {"median": 2.0, "q1": 1.5, "q3": 3.0, "min": 1.0, "max": 5.0, "n": 5}
    assert spread_of([0.7]) == {"median": 0.7, "q1": 0.7, "q3": 0.7, "min": 0.7, "max": 0.7, "n": 1}
    assert "r  " in report.table() and "IQR 1.500-3.000, range 1.000-5.000 over 5" in report.table()
    with pytest.raises(ValueError, match="at least one value"):
        spread_of([])


def test_the_verdict_says_whether_the_two_timings_agree():
    steps, processes = fake_timings()

    def notes() -> list[str]:
        return verdict({name: spread_of(v) for name, v in per_round_ratios(steps, processes).items()})

    assert notes()[0] == ("headline: DDP on 2 ranks x 1 thread trains 1.60x the samples/s of the "
                          "plain loop (1 process x 1 thread); two independent processes reach "
                          "1.60x, the bound of this machine.")
    # Interleaved: 1.1, 1.0, 0.75 (median 1.0); separate: 1.1, 1.2 (median 1.15).
    assert notes()[1] == ("ddp1_over_plain: interleaved 1.000 (IQR 0.875-1.050 over 3 rounds), "
                          "separate processes 1.150 (range 1.100-1.200 over 2 rounds): they disagree.")
    # Interleaved 1.6, 1.0, 1.6 (range 1.0-1.6); separate 1.6, 1.6.
    assert notes()[2].endswith("(range 1.600-1.600 over 2 rounds): they agree.")
    processes["ddp1"] = [1.0, 2.1]  # separate: 1.0, 1.05; each median now inside the other's range
    assert notes()[1].endswith("(range 1.000-1.050 over 2 rounds): they agree.")
