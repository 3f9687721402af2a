"""The one runner, ``ddpguide.launch.ranks``: what its result holds."""

from __future__ import annotations

import sys

import pytest

from ddpguide.launch import ranks

pytestmark = pytest.mark.multiprocess

SPEAKS = "import sys; print('out', flush=True); print('err', file=sys.stderr); sys.exit(2)"
ONLY_ERRORS = "import sys; print('usage: x', file=sys.stderr); sys.exit(2)"


def test_separate_errors_keep_each_stream_of_an_exec_d_rank():
    done = ranks.run([ranks.Command([sys.executable, "-c", SPEAKS])], 60, separate_errors=True)
    assert (done.returncodes, done.output, done.errors) == ([2], "out\n", "err\n")


def test_a_rank_that_writes_only_errors_has_them_in_the_result():
    done = ranks.run([ranks.Command([sys.executable, "-c", ONLY_ERRORS])], 60, separate_errors=True)
    assert (done.returncodes, done.output, done.errors) == ([2], "", "usage: x\n")


def test_without_separate_errors_both_streams_are_the_output():
    done = ranks.run([ranks.Command([sys.executable, "-c", SPEAKS])], 60)
    assert done.errors is None
    assert sorted(done.output.splitlines()) == ["err", "out"]
