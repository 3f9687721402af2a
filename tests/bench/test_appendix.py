"""The appendix's runner of benchmark suites: a failing suite's own error reaches the reader."""

from __future__ import annotations

import pytest

from ddpguide.bench.appendix import run_suite


@pytest.mark.timeout(120)
def test_a_failing_suite_reports_its_exit_code_and_its_error_text():
    with pytest.raises(RuntimeError, match=r"^benchmark suite 'no-such-suite' failed \(exit code 2\):\n") as info:
        run_suite("no-such-suite", timeout_s=100)
    assert "invalid choice: 'no-such-suite'" in str(info.value)
