"""The equivalence table of chapter 14, run once for the tests of this folder: every layout
with ``--cost``, so that one launch checks both its equality with one process
(``test_layouts``) and its counted bytes (``test_cost``)."""

from __future__ import annotations

import pytest

from ddpguide.gpt.layouts import CHECK, LAYOUTS, equivalence_table


@pytest.fixture(scope="session")
def table(tmp_path_factory):
    """``(rows by layout name, LayoutRun by layout name)``."""
    runs: dict = {}
    rows = equivalence_table(LAYOUTS, tmp_path_factory.mktemp("gpt"), extra=(*CHECK, "--cost"), runs=runs)
    return {row["layout"]: row for row in rows}, runs
