"""pipeline.zoo: the library schedules' action lists, their idle slots and chunks in flight."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ddpguide.pipeline import zoo

GRID = [(s, p, m) for p in (2, 4) for m in range(1, 10) for s in zoo.SCHEDULES]


def test_idle_slots_counted_from_the_action_lists_equal_the_formulas():
    checked = 0
    for schedule, p, m in GRID:
        if zoo.library_refusal(schedule, p, m) is not None:
            continue
        timeline = zoo.simulate(schedule, p, m)
        v = zoo.stages_per_rank(schedule)
        assert timeline.busy == p * v * m * 3  # every chunk's F, I and W (or B = I + W) ran once
        if zoo.formula_holds(schedule, p, m):
            assert timeline.bubble == zoo.bubble_formula(schedule, p, m), (schedule, p, m)
            checked += 1
        else:  # too few micro-batches to fill the pipe: more idle, never less
            assert timeline.bubble >= zoo.bubble_formula(schedule, p, m), (schedule, p, m)
    assert checked == 84  # of the 126 (schedule, p, m) cases, those the library accepts with m filling the pipe


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12)])
def test_the_three_bubbles(p, m):
    one_f_one_b = zoo.simulate("1F1B", p, m).bubble
    assert one_f_one_b == Fraction(p - 1, m)
    assert zoo.simulate("Interleaved1F1B", p, m).bubble == one_f_one_b / 2
    for schedule in zoo.ZERO_BUBBLE:
        assert zoo.simulate(schedule, p, m).bubble == one_f_one_b / 6


def test_chunks_in_flight():
    for p, m in ((2, 4), (4, 8), (4, 6)):
        assert zoo.in_flight("GPipe", p, m) == [m] * p
        assert zoo.in_flight("1F1B", p, m) == [min(m, p - r) for r in range(p)]
        rounds = max(1, m // p)
        per_round = m // rounds
        assert zoo.in_flight("Interleaved1F1B", p, m) == [
            min(2 * m, per_round + 2 * (p - 1 - r) + 1) for r in range(p)]
        assert zoo.in_flight("LoopedBFS", p, m) == [2 * m] * p
        for schedule in zoo.ZERO_BUBBLE:
            if zoo.library_refusal(schedule, p, m) is None:
                until_i = zoo.in_flight(schedule, p, m, until="I")
                assert all(a <= b for a, b in zip(until_i, zoo.in_flight(schedule, p, m)))


def test_library_refusals_and_comms():
    assert zoo.library_refusal("1F1B", 4, 3) == (
        "Number of microbatches (3) must be greater than or equal to the number of stages (4).")
    assert zoo.library_refusal("Interleaved1F1B", 2, 5) == (
        "Interleaved 1F1B requires the number of microbatches to be a multiple of the number "
        "of rounds (2), but got 5.")
    assert zoo.library_refusal("GPipe", 4, 3) is None
    with pytest.raises(ValueError, match="DualPipeV requires at least as many microbatches"):
        zoo.compute_actions("DualPipeV", 2, 3)
    comms = zoo.comm_actions("Interleaved1F1B", 2, 2)
    assert "0SEND_F0" in comms[0] and "1RECV_F0" in comms[1] and "1SEND_B0" in comms[1]
    with pytest.raises(ValueError, match="keeps no action list with transfers"):
        zoo.comm_actions("1F1B", 2, 2)
    with pytest.raises(ValueError, match="unknown schedule 'ZB'"):
        zoo.stages_per_rank("ZB")
