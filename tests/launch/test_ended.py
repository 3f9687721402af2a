"""How a group ended (``ddpguide.launch.ended``): one status for the group, from its ranks'."""

from __future__ import annotations

from ddpguide.launch.ended import Ended, Outcome


def ended(codes, first_failure, timed_out=False, failed_status=None) -> Ended:
    return Ended(codes, "", timed_out, first_failure, 1.0, failed_status=failed_status)


def test_the_group_s_status_is_the_first_failure_s_its_launcher_s_or_the_deadline_s():
    assert ended([0, 0], None).returncode == 0
    assert ended([0, 3], 1).returncode == 3
    assert ended([-9, 3], 1, failed_status=1).returncode == 1  # torchrun: 1 for any failure
    assert ended([None, 0], None, timed_out=True).returncode == -9
    assert ended([None, 5], 1, timed_out=True, failed_status=1).returncode == -9


def test_an_outcome_is_its_name_for_faces_that_compare_strings():
    assert [o.value for o in Outcome] == ["done", "failed", "until", "timeout"]
    assert Outcome.UNTIL == "until" and Outcome("timeout") is Outcome.TIMEOUT
