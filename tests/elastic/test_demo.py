"""The demo's cheap parts: ``run_cli`` (bad arguments, the time limit), its defaults on
the command line, and a milestone that never comes."""

from __future__ import annotations

import time

import pytest

from ddpguide.core.processes import store_port
from ddpguide.elastic import __main__ as cli
from ddpguide.elastic.cluster import LocalCluster
from ddpguide.elastic.demo import MIN_EPOCHS, DemoError, DemoSettings, _wait_for, check_crash_lands, run_cli
from ddpguide.elastic.report import RunLog


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, line", [
    (["--epochs", "3"], "error: --epochs 3: the demo needs at least 10 epochs"),
    (["--step-delay", "-0.1"], ("error: --step-delay -0.1: must be a number of seconds from 0 "
                                "to 1 (each phase of the demo has a time limit)")),
])
@pytest.mark.multiprocess
def test_run_cli_shows_a_bad_argument_and_its_exit_code(args, line):
    lines: list[str] = []
    assert run_cli(args, timeout_s=50, echo=lines.append) == 2
    assert lines == [line]


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_run_cli_kills_what_outlives_its_time_limit():
    lines: list[str] = []
    started = time.monotonic()
    code = run_cli(["store", "--port", str(store_port())], timeout_s=3, echo=lines.append)
    assert code == -9 and lines[-1] == "error: stopped after 3 s"
    assert time.monotonic() - started < 30


def test_the_command_line_defaults_are_the_demo_settings():
    args = cli._parser().parse_args(["demo"])
    assert (args.epochs, args.step_delay) == (DemoSettings.epochs, DemoSettings.step_delay)


def test_a_milestone_that_never_comes_is_an_error(tmp_path):
    cluster = LocalCluster(tmp_path)  # no node: nothing ever comes
    started = time.monotonic()
    with pytest.raises(DemoError, match=r"^no the end of training within 0.2 s\n$"):
        _wait_for(cluster, RunLog(echo=None), lambda: False, "the end of training", 0.2)
    assert time.monotonic() - started < 5


def test_a_crash_after_the_last_epoch_is_an_error_not_a_report_without_it():
    def epoch(rank: int, number: int) -> dict:
        return {"event": "epoch", "rank": rank, "world_size": 2, "epoch": number, "t": 1.0 + number,
                "loss": 0.5, "seconds": 1.0}

    log = RunLog(echo=None)
    for event in (epoch(0, MIN_EPOCHS - 2), epoch(1, MIN_EPOCHS - 1)):  # rank 0 speaks for the group
        log.worker_event(event)
    check_crash_lands(log, MIN_EPOCHS)  # one epoch left: the restarted group trains it
    log.worker_event(epoch(0, MIN_EPOCHS - 1))
    with pytest.raises(DemoError, match=rf"^training finished its {MIN_EPOCHS} epochs before the crash: "
                                        r"give it more --epochs$"):
        check_crash_lands(log, MIN_EPOCHS)


def test_the_fewest_epochs_leave_room_for_the_phases_two_late_epochs_and_the_crash():
    from ddpguide.elastic import demo

    assert MIN_EPOCHS == demo.EPOCHS_BEFORE_JOIN + demo.EPOCHS_AT_FOUR + demo.EPOCHS_BEFORE_CRASH + 3 == 10
