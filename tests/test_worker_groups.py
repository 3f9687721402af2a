"""The worker groups read from the source (``tests/worker_groups.py``), on a made-up tree and
on this suite, where the scheduler takes them."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.worker_groups import static_groups


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_a_session_fixture_asked_for_through_other_fixtures_groups_its_files(tmp_path):
    tests = tmp_path / "tests"
    write(tests / "conftest.py", """
        import pytest
        @pytest.fixture(scope="session")
        def server(): ...
        """)
    write(tests / "a" / "conftest.py", """
        import pytest
        @pytest.fixture(scope="session")
        def table(): ...
        @pytest.fixture
        def row(table): ...
        """)
    write(tests / "a" / "test_direct.py", "def test_x(table): ...\n")
    write(tests / "a" / "test_through.py", "def test_x(row): ...\n")
    write(tests / "a" / "test_alone.py", "def test_x(tmp_path): ...\n")
    write(tests / "b" / "test_row.py", "def test_x(row): ...\n")  # a's fixtures are not b's
    write(tests / "b" / "test_both.py", """
        import pytest
        @pytest.fixture
        def mine(server): ...
        def test_x(mine): ...
        """)
    assert static_groups(tests) == {
        "tests/a/test_alone.py": "tests/a/test_alone.py",
        "tests/a/test_direct.py": "session fixture table",
        "tests/a/test_through.py": "session fixture table",
        "tests/b/test_both.py": "session fixture server",
        "tests/b/test_row.py": "tests/b/test_row.py",
    }


def test_this_suite_s_shared_fixtures_keep_their_files_together():
    groups = static_groups(Path(__file__).parent)
    assert groups["tests/gpt/test_cost.py"] == groups["tests/gpt/test_layouts.py"] == "session fixture table"
    assert groups["tests/programs/test_debug_programs.py"] == "tests/programs/test_debug_programs.py"
