"""Tokens per expert from the program's router: a hot expert overflows, and the figure draws it."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from ddpguide.experts import viz  # noqa: E402


def test_a_hot_expert_takes_more_and_drops_past_capacity():
    plain, hot = viz.tokens_per_expert(0.0), viz.tokens_per_expert(2.0)
    for case in (plain, hot):
        assert sum(case["kept"]) + sum(case["dropped"]) == case["tokens"]
        assert max(case["kept"]) <= case["capacity"] == 40  # ceil(1.25 * 256 / 8)
    assert hot["kept"][0] == hot["capacity"] and hot["dropped"][0] > plain["dropped"][0]
    assert hot["aux"] > plain["aux"] >= 1.0  # 1 is its value for a perfectly balanced router


def test_the_figure_has_one_panel_per_case_with_kept_dropped_and_capacity():
    cases = [viz.tokens_per_expert(s) for s in (0.0, 2.0)]
    fig = viz.plot(cases)
    assert len(fig.axes) == 2
    for ax, case in zip(fig.axes, cases):
        kept, dropped = ax.containers
        assert [b.get_height() for b in kept] == case["kept"]
        assert [b.get_height() for b in dropped] == case["dropped"]
        assert ax.lines[0].get_ydata()[0] == case["capacity"]


def test_the_routing_follows_the_program(tmp_path):
    """An edited copy with twice the capacity: the hot expert keeps 40 more choices."""
    from ddpguide.experts.traffic import PROGRAM
    from tests.edited_programs import edited_copy

    rule = "return math.ceil(capacity_factor * tokens * k / experts)"
    edited = edited_copy(PROGRAM, tmp_path, (rule, rule.replace("return ", "return 2 * ")))
    hot, doubled = viz.tokens_per_expert(2.0), viz.tokens_per_expert(2.0, program=str(edited))
    assert (hot["capacity"], doubled["capacity"]) == (40, 80)
    assert doubled["kept"][0] == hot["kept"][0] + 40 == 80
    assert doubled["dropped"][0] == hot["dropped"][0] - 40


def test_the_balance_figure_draws_every_way_of_the_report():
    """Drawn from a balance report's shape (the program's run is tested in test_moe_program)."""
    balance = {way: {"busiest": [4.0 - i * j for j in range(5)], "z_loss": [5.0 - i] * 5}
               for i, way in enumerate(("none", "aux", "z", "bias"))}
    fig = viz.plot_balance(balance, within=1.3)
    load, z = fig.axes
    assert [line.get_label() for line in load.lines[:4]] == list(viz.WAYS.values())
    for line, run in zip(load.lines, balance.values()):
        assert list(line.get_ydata()) == run["busiest"] and list(line.get_xdata()) == [1, 2, 3, 4, 5]
    assert [list(line.get_ydata()) for line in z.lines] == [run["z_loss"] for run in balance.values()]
    assert load.lines[4].get_ydata()[0] == 1.3
