"""The time check can fail: each term of the model doubled, scored on the saved cluster run.

The saved run's steps are mostly communication (20mbit links): a doubled collective or bubble
moves layouts out of 0.8-1.25. Its four ranks got 1.06 cores of the shared machine, so compute
is up to a third of the pipelines' steps and a doubled compute moves them out too. What the
check is blind to there is asserted as well (overlap: nothing is hidden behind so little
compute; all-to-all: no layout has experts), so that a run which sees it shows up as a change."""

from __future__ import annotations

import pytest

from ddpguide.plan import catalog, checks, perturb, saved, search


@pytest.fixture(scope="module")
def scored():
    p = search.program()
    bench = saved.load()
    rows, hw = saved.rows(p, bench), saved.cluster_hardware(p, bench)
    args = (saved.model(p), catalog.policy(p, "float32"), hw, checks.TIME_BATCH, checks.TIME_SEQ)
    return perturb.check(p, rows, *args), perturb.shares(p, rows, *args), rows


def test_the_model_as_it_is_passes(scored):
    found, _, rows = scored
    assert found[""]["within"] == len(rows) and found[""]["rank_correlation"] >= 0.8


@pytest.mark.parametrize("term", ["compute", "bubble", "all_gather", "reduce_scatter", "all_reduce", "send_recv"])
def test_a_doubled_term_fails_the_check(scored, term):
    found, _, _ = scored
    assert found[term]["out_of_band"] == 1 and found[term]["moved_out"] >= 3, found[term]


def test_overlap_and_all_to_all_are_not_checked_by_the_saved_run(scored):
    found, shares, rows = scored
    pipelines = [s for s, r in zip(shares, rows) if r["layout"].pp > 1]
    assert 0.25 < max(shares) == max(pipelines) < 0.5 and max(s for s in shares if s not in pipelines) < 0.25
    assert found["overlap"]["out_of_band"] == 0 and found["all_to_all"]["out_of_band"] == 0
    assert found["all_to_all"]["moved_out"] == 0  # no layout of the saved run has experts


def test_doubling_is_through_the_whole_simulation():
    """A doubled collective is the program's collective() doubled, and restored after."""
    p = search.program()
    model, pol = catalog.model(p, "gpt-check"), catalog.policy(p, "float32")
    hw = p.Hardware(gpus_per_node=2, nics=1, backend="gloo", streams=False)
    lay = p.Layout(dp_replicate=2, dp_shard=2)
    before = p.step(model, lay, pol, hw, 8, 16)["total"]
    doubled = perturb.step(p, "all_reduce", model, lay, pol, hw, 8, 16)
    assert doubled > before and p.step(model, lay, pol, hw, 8, 16)["total"] == before
    with pytest.raises(ValueError, match="no term 'nccl'"):
        perturb.step(p, "nccl", model, lay, pol, hw, 8, 16)


def test_a_row_is_predicted_with_its_own_model_and_hardware():
    """A loopback row carries the model, batch, sequence and hardware it ran with (the rate
    beside its run): check() and shares() predict it with those, not the call's defaults."""
    p = search.program()
    pol = catalog.policy(p, "float32")
    hw = p.Hardware(gpus_per_node=2, nics=1, backend="gloo", streams=False, peak=1e10)
    slow = p.Hardware(gpus_per_node=2, nics=1, backend="gloo", streams=False, peak=1e9)
    wide, narrow = (catalog.model(p, "gpt", layers=2, dim=d, heads=4, ffn=4 * d) for d in (256, 32))
    lay = p.Layout(dp_replicate=2)
    own = {"layout": lay, "model": wide, "hardware": slow, "batch": 8, "seq": 64}
    step = p.step(wide, lay, pol, slow, 8, 64)
    rows = [{**own, "measured": step["total"]}, {**own, "measured": 2 * step["total"]}]
    found = perturb.check(p, rows, narrow, pol, hw, 2, 16)
    assert found[""]["inside"] == [True, False]
    assert perturb.shares(p, rows, narrow, pol, hw, 2, 16)[0] == step["compute"] / step["total"]
