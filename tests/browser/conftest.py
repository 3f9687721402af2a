"""Fixtures for the browser tests: the built book, a local server, headless Chromium.

The pages to check come from ``_toc.yml``, so a chapter is tested as soon as
it is in the table of contents. Without a built book or without Chromium these
tests skip, saying why, except in CI (``CI=true``), where both are required and
their absence fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.browser import cdp_client
from tests.browser.browser_support import HTML, Visitor, serve, toc_pages, unavailable
from tests.browser.cdp_client import Chromium
from tests.process_guard import guard, live_children

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "page" in metafunc.fixturenames:
        pages = toc_pages()
        metafunc.parametrize("page", pages, ids=pages)


@pytest.fixture(scope="session")
def book_html() -> Path:
    if not (HTML / "index.html").exists():
        unavailable(f"the book is not built ({HTML / 'index.html'} is missing): "
                    "run `make test`, or `make book` first")
    return HTML


@pytest.fixture(scope="session")
def chromium_path() -> str:
    explicit = os.environ.get("CHROMIUM")
    for name in ([explicit] if explicit else []) + list(CHROMIUM_NAMES):
        found = shutil.which(name)
        if found:
            return found
    unavailable("Chromium is not installed (Debian: apt-get install chromium; "
                "or set CHROMIUM=/path/to/chrome)")
    raise AssertionError("not reached")


@pytest.fixture(scope="session")
def server(book_html: Path) -> Iterator[str]:
    """The built book served on a free loopback port; yields its base URL."""
    with serve(book_html) as url:
        yield url


@pytest.fixture(scope="session")
def browser(chromium_path: str) -> Iterator[Chromium]:
    chromium = Chromium(chromium_path)
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture(scope="session")
def visitor(browser: Chromium, server: str) -> Visitor:
    return Visitor(browser, server)


def _is_running_chromium(process: psutil.Process) -> bool:
    return bool({process.pid, *(p.pid for p in process.parents())} & cdp_client.RUNNING)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """tests/conftest.py's check, but the session's Chromium may outlive a test.

    Chromium lives for the whole session (one browser, a tab per page), and
    starts and keeps renderer processes as it likes; the browser fixture ends
    it, with all of them, when the session ends. Any other process a test
    leaves behind still fails it.
    """
    yield from guard(lambda: live_children(ignore=_is_running_chromium))
