"""Shared fixtures: every test must leave no child process behind, and a test that starts
a process is marked ``multiprocess`` (``tests/process_marks.py``).

A book program that a test runs through ``ddpguide.launch.programs.run`` has its ranks
forked from the warm server, with the variables torchrun gives its workers
(``programs.LAUNCH = "typed-once"``, ``ddpguide.launch.forked``): seconds less per run, the
same program. Each program's first run in a test process is typed instead (torchrun and
fresh interpreters, which go through interpreter teardown, as the chapters run every
program), and so is every run of a test marked ``typed``. The switch is this process's
own setting, never an environment variable, so no process a test starts inherits it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpguide.launch import programs
from tests import worker_groups
from tests.process_guard import guard
from tests.process_marks import ProcessWatch, mark_items


def pytest_configure(config):
    # matplotlib asks fc-list for the fonts once a machine, the first time it is imported (a new
    # machine has no font cache): here, before any test is watched for processes it starts
    import matplotlib.font_manager  # noqa: F401

    config._process_watch = ProcessWatch()
    programs.LAUNCH = "typed-once"  # before any fixture, session-wide ones included


def pytest_unconfigure(config):
    watch = getattr(config, "_process_watch", None)
    if watch is not None:
        watch.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    mark_items(items)
    if config.pluginmanager.hasplugin("xdist"):  # the scheduler's groups, read from the source
        found = worker_groups.collected_groups(items)
        expected = worker_groups.static_groups(Path(__file__).parent)
        wrong = sorted(f"{path}: {group!r}, read from the source {expected.get(path)!r}"
                       for path, group in found.items()
                       if path.startswith("tests/") and expected.get(path) != group)
        if wrong:
            raise pytest.UsageError("tests/worker_groups.py reads the wrong worker group for "
                                    + "; ".join(wrong))


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: a file's tests in one worker, and the files of a session fixture
    together (``tests/worker_groups.py``)."""
    if config.getvalue("dist") == "loadgroup":
        return worker_groups.scheduler(config, log, worker_groups.static_groups(Path(__file__).parent))
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") and os.environ.get("DDPGUIDE_SLOW") != "1":
        pytest.skip("slow: run with `make test-slow` (DDPGUIDE_SLOW=1)")
    item.config._process_watch.begin(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    item.config._process_watch.check(item)
    return result


@pytest.fixture(autouse=True)
def program_launch(request, monkeypatch):
    """Programs run as typed in a test marked ``typed``, forked in every other."""
    if request.node.get_closest_marker("typed"):
        monkeypatch.setattr(programs, "LAUNCH", "typed")


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test whose child processes are still alive 5 s after it ends."""
    yield from guard()


@pytest.fixture(scope="module")
def spawned(request):
    """``spawned(world)``: every rank's results of the test module's ``_calls(world)``.

    The calls run one after another in one process group per world size, started
    once for the module (a start costs seconds), through ``run_several``. A group that
    fails is reported in full by the first test that asked for it; the module's other
    tests fail with one line that points there.
    """
    from ddpguide.launch.spawn import run_several, spawn

    cache: dict[int, list[dict]] = {}
    failed: dict[int, str] = {}

    def results(world: int) -> list[dict]:
        if world in failed:
            pytest.fail(failed[world], pytrace=False)
        if world not in cache:
            try:
                cache[world] = spawn(run_several, world, request.module._calls(world),
                                     timeout=240, echo=False)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # a timeout is a pytest outcome, not an Exception
                first = os.environ.get("PYTEST_CURRENT_TEST", "?").rpartition(" ")[0]
                failed[world] = (f"the group of {world} ranks shared by this module failed "
                                 f"to start or run ({type(exc).__name__}): reported in full "
                                 f"by {first}")
                raise
        return cache[world]

    return results


@pytest.fixture
def unwritable_directory() -> tuple[str, str]:
    """A directory nobody may create files in, root included (``/sys``), and the reason
    the kernel gives; the test is skipped where it is writable."""
    directory = "/sys"
    try:
        os.close(os.open(f"{directory}/ddpguide-probe", os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError as exc:
        return directory, exc.strerror
    pytest.skip(f"{directory} is writable here")
