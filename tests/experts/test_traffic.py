"""The bytes of the all-to-alls, counted on real ranks, equal the formula for a balanced router."""

from __future__ import annotations

import pytest

from ddpguide.experts import traffic


def test_formula():
    assert traffic.formula(64, 16, 8, 2) == 64 * 16 * 8 * 2 * 1 / 2
    assert traffic.formula(64, 16, 8, 4) == 64 * 16 * 8 * 2 * 3 / 4
    assert traffic.formula(64, 16, 8, 1) == 0
    with pytest.raises(ValueError, match="formula needs ranks >= 1"):
        traffic.formula(64, 16, 8, 0)


def test_bytes_sent_off_rank_skip_the_rank_itself():
    import torch

    rows = torch.zeros(10, 3, dtype=torch.float64)
    assert traffic.sent_off_rank(rows, [4, 6], rank=0, ranks=2) == 6 * 3 * 8
    assert traffic.sent_off_rank(rows, [4, 6], rank=1, ranks=2) == 4 * 3 * 8
    assert traffic.sent_off_rank(torch.zeros(4, dtype=torch.int64), None, 1, 4) == 3 * 8


def test_a_balanced_batch_routes_token_t_to_expert_t_mod_e():
    import torch

    from ddpguide.launch.programs import load

    program = load(traffic.PROGRAM)
    layer = program.make_layer(16, 32, 4, seed=0)
    x = traffic.balanced(layer, 64, 16)
    probs = torch.softmax(layer.router(layer.norm(x)), dim=-1)
    assert torch.equal(probs.argmax(1), torch.arange(64) % 4)
    with pytest.raises(ValueError, match="a balanced batch needs hidden >= E"):
        traffic.balanced(layer, 63, 16)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_counted_bytes_equal_the_formula(ranks):
    tokens, hidden, experts = 64, 16, 4
    results = traffic.count(ranks, tokens=tokens, hidden=hidden, experts=experts)
    for r in results:
        assert r["dropped"] == 0
        assert r["per_expert"] == [ranks * tokens // experts] * (experts // ranks)  # T/E from each rank
        assert r["token_bytes"] == r["formula"] == traffic.formula(tokens, hidden, 8, ranks)
        assert r["counts_bytes"] == (ranks - 1) * (experts // ranks) * 8
        assert r["backward_bytes"] == r["token_bytes"]  # the same two exchanges, reversed
        assert [c["dtype"] for c in r["forward"]] == ["int64", "float64", "float64"]
