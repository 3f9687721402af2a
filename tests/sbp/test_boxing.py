"""Hand-written boxing against DTensor's ``redistribute``: every pair, 1D and 2D, even and uneven.

One 4-rank spawn (module fixture) runs every comparison; the tests read its records.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial

from ddpguide.launch.spawn import spawn
from ddpguide.sbp import boxing_by_hand, boxing_rules
from ddpguide.sbp.boxing_by_hand import _Axis
from ddpguide.sbp.boxing_rules import BoxingError
from ddpguide.sbp.placements import B, P, S, as_placements
from ddpguide.sbp.workers import comparison_rows, run

WORLD = 4
SHAPES_1D = ((4, 8), (5, 3), (6, 2))
SHAPES_2D = ((4, 4), (5, 3))


@pytest.fixture(scope="module")
def records():
    ranks = spawn(run, WORLD, ["boxing_all"], timeout=200, collective_timeout=60, echo=False,
                  kwargs={"options": {"boxing_all": {"shapes_1d": SHAPES_1D, "shapes_2d": SHAPES_2D}}})
    return [dict(rec, rank=rank) for rank, result in enumerate(ranks) for rec in result["boxing_all"]]


# ---------------------------------------------------------------- the rules as data

def test_every_pair_has_a_rule():
    kinds = (B, S(0), S(1), P)
    rule = boxing_rules.rule
    hows = {(rule(a, b).src, rule(a, b).dst): rule(a, b).how for a in kinds for b in kinds}
    assert hows[("S", "B")] == "all_gather" and hows[("P", "B")] == "all_reduce"
    assert hows[("P", "S")] == "reduce_scatter" and hows[("S", "S'")] == "all_to_all"
    assert hows[("B", "S")] == "local slice" and hows[("B", "P")] == "local scale"
    assert hows[("S", "P")] == "local zero-fill"
    assert rule(S(0), S(0)).collective is None and rule(S(0), S(1)).collective == "all_to_all"


def test_changing_the_kind_of_reduction_is_refused():
    with pytest.raises(BoxingError, match=r"^P -> P\(max\) would change the pending reduction; "
                                          r"reduce first \(P -> B\), then B -> P\(max\)$"):
        boxing_rules.rule(P, Partial("max"))
    with pytest.raises(BoxingError, match=r"hand-written boxing covers P\(sum\) only, got P\(max\)"):
        boxing_rules.rule(Partial("max"), B)
    with pytest.raises(BoxingError, match="have different mesh ranks"):
        boxing_rules.plan((B,), (B, B))


def test_rule_table_bytes():
    rows = {(r["from"], r["to"]): r["bytes sent per rank"] for r in boxing_rules.rule_table(4, 128)}
    assert rows[("S(0)", "B")] == 96 and rows[("P", "B")] == 192
    assert rows[("P", "S(1)")] == 96 and rows[("S(0)", "S(1)")] == 24
    assert rows[("B", "P")] == rows[("S(1)", "P")] == rows[("B", "S(0)")] == 0
    text = boxing_rules.markdown_table(boxing_rules.rule_table(4, 128), ["from", "to", "how"])
    assert text.splitlines()[:3] == ["| from | to | how |", "|---|---|---|", "| B | B | nothing |"]


def test_nested_splits_are_undone_inner_first():
    steps = [str(s) for s in boxing_rules.plan((S(0), S(0)), (B, S(0)))]
    assert steps == ["mesh dim 1: S(0) -> B (all_gather)", "mesh dim 0: S(0) -> B (all_gather)",
                     "mesh dim 1: B -> S(0) (local slice)"]
    assert [str(s) for s in boxing_rules.plan((B, S(0)), (S(1), S(0)))] == \
        ["mesh dim 0: B -> S(1) (local slice)"]


@pytest.mark.parametrize("rows", [4, 5, 6])
def test_local_steps_without_communication(rows):
    x = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
    axes = [_Axis(None, 4, k, 0) for k in range(4)]
    pieces = [boxing_by_hand.take_chunk(x, 0, a) for a in axes]
    expected = list(x.chunk(4)) + [x[:0]] * (4 - len(x.chunk(4)))
    assert all(torch.equal(p, e) for p, e in zip(pieces, expected))
    for zero_fill in (False, True):
        assert torch.equal(sum(boxing_by_hand.split_into_partials(x, a, zero_fill) for a in axes), x)
    filled = [boxing_by_hand.shard_to_partial(p, 0, x.shape, a) for p, a in zip(pieces, axes)]
    assert all(f.shape == x.shape for f in filled) and torch.equal(sum(filled), x)


# ---------------------------------------------------------------- against DTensor on 4 ranks

@pytest.mark.timeout(240)
def test_every_pair_matches_dtensor(records):
    meshes = {r["mesh"] for r in records}
    assert meshes == {(4,), (2,), (2, 2)}
    assert len(records) == WORLD * (2 * 16 * len(SHAPES_1D) + 256 * len(SHAPES_2D))
    compared = 0
    for r in records:
        where = (r["rank"], r["mesh"], r["shape"], r["src"], r["dst"])
        if r["theirs"] is not None:
            assert r["mine"].shape == r["theirs"].shape, where
            assert torch.equal(r["mine"], r["theirs"]), where
            compared += 1
        # Whatever DTensor says, our pieces must still make up the same logical tensor.
        assert torch.equal(r["mine_full"], r["source_full"]), where
    assert compared > 0.8 * len(records)


@pytest.mark.timeout(240)
def test_dtensor_refuses_exactly_broadcast_to_partial(records):
    for r in records:
        src = as_placements(r["src_each"], len(r["mesh"]))
        dst = as_placements(r["dst_each"], len(r["mesh"]))
        b_to_p = any(s == B and isinstance(d, Partial) for s, d in zip(src, dst))
        assert (r["refused"] is not None) == b_to_p, (r["src"], r["dst"])
        if b_to_p:
            assert r["refused"].startswith("Can not redistribute from R to P(sum)")


@pytest.mark.timeout(240)
def test_1d_collectives_and_bytes_match_the_table(records):
    for r in records:
        if len(r["mesh"]) != 1:
            continue
        n = r["mesh"][0]
        src, dst = as_placements(r["src_each"], 1)[0], as_placements(r["dst_each"], 1)[0]
        rule = boxing_rules.rule(src, dst)
        ours = [c for c, _, _ in r["mine_comms"]]
        assert ours == ([rule.collective] if rule.collective else []), (r["src"], r["dst"])
        if r["shape"][0] % n == 0 and r["shape"][1] % n == 0:
            assert sum(b for _, _, b in r["mine_comms"]) == round(rule.traffic(n) * r["nbytes"])
        # DTensor runs the same collective, except that gloo has no all-to-all
        # path in DTensor: S(i) -> S(j) becomes an all-gather and a local slice.
        expected = {rule.collective: 1} if rule.collective else {}
        if rule.how == "all_to_all" and r["device_type"] == "cpu":
            expected = {"all_gather": 1}
        if r["refused"] is None:
            assert r["theirs_comms"] == expected, (r["src"], r["dst"])


@pytest.mark.timeout(240)
def test_comparison_rows_render(records):
    first = [r for r in records if r["rank"] == 0 and r["mesh"] == (4,) and r["shape"] == (4, 8)]
    rows = comparison_rows(first, "gloo")
    assert len(rows) == 16
    by_pair = {(row["from"], row["to"]): row for row in rows}
    assert by_pair[("P", "B")]["hand-written"] == "all_reduce"
    assert by_pair[("P", "B")]["bytes sent per rank"] == 2 * 3 * 4 * 8 * 8 // 4
    assert by_pair[("B", "P")]["DTensor (gloo)"] == "refuses"
    assert all(row["same logical tensor"] is True for row in rows)
