"""How a group ended (``ddpguide.launch.ended``): one status for the group, from its ranks'."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpguide
from ddpguide.launch.ended import Ended, Outcome


def ended(codes, first_failure, timed_out=False, failed_status=None) -> Ended:
    return Ended(codes, "", timed_out, first_failure, 1.0, failed_status=failed_status)


def test_the_group_s_status_is_the_first_failure_s_its_launcher_s_or_the_deadline_s():
    assert ended([0, 0], None).returncode == 0
    assert ended([0, 3], 1).returncode == 3
    assert ended([-9, 3], 1, failed_status=1).returncode == 1  # torchrun: 1 for any failure
    assert ended([None, 0], None, timed_out=True).returncode == -9
    assert ended([None, 5], 1, timed_out=True, failed_status=1).returncode == -9


def test_an_outcome_is_no_string_so_a_face_that_compares_one_with_a_string_fails():
    assert [o.value for o in Outcome] == ["done", "failed", "until", "timeout"]
    assert Outcome("timeout") is Outcome.TIMEOUT
    assert Outcome.UNTIL != "until" and not isinstance(Outcome.UNTIL, str)


def string_comparisons_of_outcomes(root: Path) -> list[str]:
    """``file:line`` of each ``group.wait(...) == "until"`` or ``outcome != "done"`` below ``root``."""
    values = {o.value for o in Outcome}
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if not any(f'"{v}"' in text or f"'{v}'" in text for v in values):
            continue  # no outcome's value as a string: nothing to compare with
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            left = node.left
            waited = isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr == "wait"
            named = isinstance(left, ast.Name) and "outcome" in left.id
            if (waited or named) and any(isinstance(c, ast.Constant) and c.value in values
                                         for c in node.comparators):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_face_compares_an_outcome_with_a_string(tmp_path):
    assert string_comparisons_of_outcomes(Path(ddpguide.__file__).parent) == []
    (tmp_path / "face.py").write_text('def f(group):\n    outcome = group.wait(1)\n'
                                      '    return group.wait(2) != "until" or outcome == "failed"\n')
    assert string_comparisons_of_outcomes(tmp_path) == ["face.py:3", "face.py:3"]
