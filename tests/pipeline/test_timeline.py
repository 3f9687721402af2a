"""pipeline.timeline: the one simulator, its dependencies, its bubble, at equal and unequal costs."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from ddpguide.pipeline import timeline, zoo
from ddpguide.pipeline.timeline import Costs, Op

UNEQUAL = [Costs(*fiw) for fiw in itertools.product((1, 2, 3), repeat=3)]
UNEQUAL += [Costs(F=1, B=1), Costs(F=3, B=1), Costs(F=1, I=1, W=1, B=5)]


def rows(tl):
    return [" ".join(f"{op.kind}{op.mb}" if op else "." for op in row) for row in tl.grid]


def test_gpipe_grid_for_two_stages():
    tl = zoo.simulate("GPipe", 2, 3, Costs(F=1, B=1))
    assert rows(tl) == ["F0 F1 F2 . . B0 B1 B2", ". F0 F1 F2 B0 B1 B2 ."]
    assert tl.makespan == 2 * (3 + 2 - 1) and tl.idle == 4 and tl.busy == 12
    assert tl.bubble == Fraction(1, 3)  # idle over busy: (p - 1)/m


def test_1f1b_grid_for_three_stages():
    tl = zoo.simulate("1F1B", 3, 4, Costs(F=1, B=1))
    assert rows(tl) == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3 .",
        ". . F0 B0 F1 B1 F2 B2 F3 B3 . .",
    ]
    assert tl.bubble == Fraction(2, 4)
    assert Fraction(tl.idle, tl.grid.size) == Fraction(2, 4 + 3 - 1)  # the idle share of the step: bubble/(1 + bubble)


def spans(tl):
    """{(stage, kind, mb): (rank, start, end)} read back from the grid."""
    out: dict = {}
    for r, row in enumerate(tl.grid):
        for t, op in enumerate(row):
            if op is not None:
                key = (op.stage, op.kind, op.mb)
                out[key] = (r, out.get(key, (r, t, t))[1], t + 1)
    return out


CASES = [(s, p, m) for s in zoo.SCHEDULES for p, m in ((2, 4), (4, 8), (3, 6)) if zoo.library_refusal(s, p, m) is None]


@pytest.mark.parametrize("schedule, p, m", CASES)
@pytest.mark.parametrize("costs", [Costs(), Costs(2, 3, 1), Costs(1, 2, 3)], ids=str)
def test_every_action_waits_for_its_input_and_runs_once(schedule, p, m, costs):
    tl = zoo.simulate(schedule, p, m, costs)
    found = spans(tl)
    n = p * zoo.stages_per_rank(schedule)
    for (stage, kind, mb), (_, start, end) in found.items():
        assert end - start == costs.of(kind)
        if kind == "F" and stage:
            assert start >= found[(stage - 1, "F", mb)][2]
        if kind in "BI":
            before = (stage, "F", mb) if stage == n - 1 else next(
                k for k in ((stage + 1, "B", mb), (stage + 1, "I", mb)) if k in found)
            assert start >= found[before][2]
        if kind == "W":
            assert start >= found[(stage, "I", mb)][2]
    assert tl.busy == sum(costs.of(k) for (_, k, _) in found)
    assert len(found) == sum(len(r) for r in zoo.compute_actions(schedule, p, m))


def longest_path(ranks, n_stages, costs):
    """The earliest finish of the whole schedule, as the longest path through the graph of
    each rank's order and the data dependencies (computed apart from the simulator)."""
    finish: dict = {}
    keys = {(op.stage, op.kind, op.mb) for order in ranks for op in order}

    def deps(op, r, i):
        found = [(r, i - 1)] if i else []
        if op.kind == "F" and op.stage:
            found.append((op.stage - 1, "F", op.mb))
        elif op.kind == "W":
            found.append((op.stage, "I", op.mb))
        elif op.stage == n_stages - 1:
            found.append((op.stage, "F", op.mb))
        elif op.kind in "BI":
            found.append(next(k for k in ((op.stage + 1, "B", op.mb), (op.stage + 1, "I", op.mb)) if k in keys))
        return found

    where = {(op.stage, op.kind, op.mb): (r, i) for r, order in enumerate(ranks) for i, op in enumerate(order)}

    def end(r, i):
        if (r, i) not in finish:
            op = ranks[r][i]
            starts = [end(*d) if len(d) == 2 else end(*where[d]) for d in deps(op, r, i)]
            finish[(r, i)] = max(starts, default=0) + costs.of(op.kind)
        return finish[(r, i)]

    return max(end(r, len(order) - 1) for r, order in enumerate(ranks))


@pytest.mark.parametrize("schedule", zoo.SCHEDULES)
def test_makespan_is_the_longest_path_at_unequal_costs(schedule):
    for costs in UNEQUAL[::4]:
        for p, m in ((2, 4), (4, 8)):
            ranks = zoo.compute_actions(schedule, p, m)
            n = p * zoo.stages_per_rank(schedule)
            assert zoo.simulate(schedule, p, m, costs).makespan == longest_path(ranks, n, costs), (costs, p, m)


@pytest.mark.parametrize("schedule", ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"))
def test_fill_and_drain_formulas_hold_at_any_costs(schedule):
    """(p-1)/m and (p-1)/(vm): the fill is (p-1)(F+B)/v per rank against m(F+B) of work."""
    checked = 0
    for p in (2, 3, 4):
        for m in range(1, 13):
            if zoo.library_refusal(schedule, p, m) is not None or not zoo.formula_holds(schedule, p, m):
                continue
            for costs in UNEQUAL:
                assert zoo.simulate(schedule, p, m, costs).bubble == zoo.bubble_formula(schedule, p, m), \
                    (p, m, costs)
                checked += 1
    assert checked > 300


@pytest.mark.parametrize("schedule", zoo.ZERO_BUBBLE)
def test_zero_bubble_count_is_a_forward_per_hop_only_at_equal_costs(schedule):
    p, m = 4, 8
    v = zoo.stages_per_rank(schedule)
    for c in (1, 2, 3):  # F = I = W: (p - 1) F idle per rank, (p - 1)/(3 v m)
        tl = zoo.simulate(schedule, p, m, Costs(c, c, c))
        assert tl.idle_per_rank() == [(p - 1) * c] * p
        assert tl.bubble == zoo.bubble_formula(schedule, p, m) == Fraction(p - 1, 3 * v * m)
    differs = 0
    for costs in UNEQUAL[:27]:
        tl = zoo.simulate(schedule, p, m, costs)
        idle = tl.idle_per_rank()
        # a synchronous step cannot hide the fill: the last rank starts after p - 1 forwards
        assert min(idle) >= (p - 1) * costs.F, costs
        assert tl.busy == p * v * m * (costs.F + costs.I + costs.W)
        differs += idle[0] != (p - 1) * (costs.F + costs.I - costs.W)
    assert differs > 0  # (p-1)(F+I-W) is not the count in general
    assert zoo.simulate(schedule, p, m, Costs(1, 2, 2)).idle_per_rank()[0] > (p - 1) * (1 + 2 - 2)


def test_unequal_costs_tell_the_zero_bubble_schedules_apart():
    """At p = 4, m = 8, with W cheaper than I, ZBV idles less than the other two."""
    idle = {s: zoo.simulate(s, 4, 8, Costs(2, 2, 1)).idle_per_rank()[0] for s in zoo.ZERO_BUBBLE}
    assert idle["ZBVZeroBubble"] == 3 * 2  # the fill alone, (p - 1) F
    assert idle["InterleavedZeroBubble"] > idle["ZBVZeroBubble"] < idle["DualPipeV"]


def test_in_flight_and_bad_input():
    ranks = [[Op(0, "F", 0), Op(0, "F", 1), Op(0, "I", 0), Op(0, "W", 0), Op(0, "B", 1)]]
    assert timeline.in_flight(ranks) == [2] and timeline.in_flight(ranks, until="I") == [2]
    assert timeline.in_flight([[Op(0, "F", 0), Op(0, "I", 0), Op(0, "F", 1), Op(0, "W", 0)]]) == [2]
    assert timeline.in_flight([[Op(0, "F", 0), Op(0, "I", 0), Op(0, "F", 1), Op(0, "W", 0)]], "I") == [1]
    kept = [[Op(0, "F", 0), Op(0, "I", 0), Op(0, "W", 0), Op(0, "F", 1), Op(0, "B", 1)]]
    assert timeline.held_until_step_end(kept) == [Fraction(3, 2)]  # half of chunk 0 stays after its W
    assert timeline.held_until_step_end(kept, share=Fraction(0)) == timeline.in_flight(kept) == [1]
    with pytest.raises(ValueError, match=r"^until must be 'last' or 'I', got 'W'$"):
        timeline.in_flight(ranks, until="W")
    with pytest.raises(ValueError, match=r"^cost I must be a whole number of time units >= 1, got 0$"):
        Costs(I=0)
    with pytest.raises(ValueError, match=r"^cost F must be a whole number of time units >= 1, got 1.5$"):
        Costs(F=1.5)  # type: ignore[arg-type]
    assert Costs().of("B") == 2 and Costs(I=2, W=3).of("B") == 5 and Costs(B=7).of("B") == 7
    # rank 0 waits for the backward of stage 1, which rank 1 runs only after its own forward 1
    with pytest.raises(RuntimeError, match="^crossed deadlocks: every rank waits for an input$"):
        timeline.simulate([[Op(0, "F", 0), Op(0, "B", 0), Op(0, "F", 1)],
                           [Op(1, "F", 1), Op(1, "F", 0), Op(1, "B", 0)]], 2, schedule="crossed")
