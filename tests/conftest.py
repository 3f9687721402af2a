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

import pytest

from ddpguide.launch import programs
from tests.process_guard import guard
from tests.process_marks import ProcessWatch, mark_items


def pytest_configure(config):
    config._process_watch = ProcessWatch()
    programs.LAUNCH = "typed-once"  # before any fixture, session-wide ones included


def pytest_unconfigure(config):
    watch = getattr(config, "_process_watch", None)
    if watch is not None:
        watch.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    mark_items(items)
    if config.pluginmanager.hasplugin("xdist"):
        groups = worker_groups(items)
        for item in items:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.split("::")[0]]))


def worker_groups(items) -> dict[str, str]:
    """Test file -> the pytest-xdist worker group it runs in (``make test`` runs
    ``--dist loadgroup``): a file's tests together, so that its module fixtures start
    once, and the files that use one of this suite's session fixtures together, so
    that it runs once."""
    shared: dict[str, set[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = shared.setdefault(item.nodeid.split("::")[0], set())
        names.update(name for name, defs in (info.name2fixturedefs.items() if info else ())
                     if defs and defs[-1].scope == "session" and defs[-1].baseid.startswith("tests"))
    return {path: f"session fixture {min(names)}" if names else path for path, names in shared.items()}


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
