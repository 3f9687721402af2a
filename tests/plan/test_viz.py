"""The chapter's explorer: the static tables and bars, and the live form."""

from __future__ import annotations

from ddpguide.plan import search, viz


def test_static_html_has_a_table_and_bars_per_case():
    p = search.program()
    page = viz.static_html(p, [("llama3-8b", 8, "H100", 8192, 16)], top=3)
    assert page.count("<table") == 1 and page.count("<tr>") == 4  # the head and three layouts
    assert "FSDP 8" in page and "parameters:" in page and "GiB" in page


def test_explorer_draws_the_default_case_and_ranks_again_on_a_change():
    p = search.program()
    controls, table = viz.explorer(p).children  # a table and no picture
    assert [c.description for c in controls.children] == ["model", "gpus", "hardware", "seq", "global batch"]
    assert table.value == viz.ranked_html(*viz.case(p, "llama3-8b", 8, "H100", 8192, 16))
    controls.children[1].value = 16
    assert table.value == viz.ranked_html(*viz.case(p, "llama3-8b", 16, "H100", 8192, 16))
