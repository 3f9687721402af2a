"""What the browser tests share: the pages of the book, and a visitor that opens them.

Each page is opened once, in its own tab; what the tests need from it is
collected into a :class:`PageReport`, and a screenshot of it is kept in
``_build/screenshots/`` (CI keeps that folder as an artefact).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest
import yaml

from tests.browser.cdp_client import Chromium, Request, Tab

ROOT = Path(__file__).absolute().parents[2]
HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

sys.path.insert(0, str(ROOT / "tools"))
from mirror_book import toc_files  # noqa: E402


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on a free loopback port; yields its base URL, then stops the server."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)

# How long a page may take to load, render its widgets and typeset its math.
PAGE_TIMEOUT_S = 60.0


def unavailable(reason: str) -> None:
    """Skip on a developer's machine; fail in CI, where everything must be there."""
    if IN_CI:
        pytest.fail(f"{reason} (required in CI)", pytrace=False)
    pytest.skip(reason)


def toc_pages() -> list[str]:
    """Document names of every page in ``_toc.yml`` (``book/intro``, ...), in order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [str(Path(f).with_suffix("")) if Path(f).suffix in (".md", ".ipynb") else f
            for f in toc_files(toc)]


# Runs in the page once it has loaded: waits (bounded) until images are done,
# widgets are drawn and math is typeset, then returns what the tests check.
COLLECT_JS = r"""
(async (timeoutMs) => {
  const deadline = Date.now() + timeoutMs;
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const views = () => [...document.querySelectorAll(
      'script[type="application/vnd.jupyter.widget-view+json"]')];
  const drawn = s => { const p = s.previousElementSibling;
      return !!p && p.classList.contains('widget-subarea') && p.childElementCount > 0; };
  const maths = () => [...document.querySelectorAll('.math')];
  for (const img of document.images) { if (img.loading === 'lazy') img.loading = 'eager'; }
  while (Date.now() < deadline) {
    const busy = [...document.images].some(i => !i.complete)
        || views().some(s => !drawn(s))
        || maths().some(m => !m.querySelector('mjx-container'));
    if (!busy) break;
    await sleep(100);
  }
  const state = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]');
  const h1 = document.querySelector('article h1') || document.querySelector('h1');
  const hrefs = sel => [...document.querySelectorAll(sel)].map(a => a.href);
  return {
    title: h1 ? h1.textContent.replace(/[#¶]\s*$/, '').trim() : '',
    images: [...document.images].map(i => ({src: i.currentSrc || i.src,
        loaded: i.complete && i.naturalWidth > 0, width: i.naturalWidth})),
    cells: [...document.querySelectorAll('div.cell')].map(c => ({
        source: ((c.querySelector('.cell_input') || {}).innerText || '').trim().split('\n')[0].slice(0, 100),
        tags: [...c.classList].filter(x => x.startsWith('tag_')).map(x => x.slice(4)),
        outputs: [...c.querySelectorAll('.cell_output > .output')].map(o => ({
            kinds: [...o.classList].filter(x => !['output', 'notranslate'].includes(x)
                && !x.startsWith('highlight')),
            text: o.innerText.slice(0, 20000)})),
        // Text blocks of the outputs rendered from Markdown or HTML (not printed text,
        // not code): the text of each block without its code, math and nested blocks.
        rendered: [...c.querySelectorAll('.cell_output')].flatMap(o => [...o.querySelectorAll(
            'p, li, h1, h2, h3, h4, h5, h6, td, th, dt, dd, caption')]
            .filter(e => !e.closest('pre, .highlight, .widget-subarea'))
            .map(e => { const k = e.cloneNode(true);
                k.querySelectorAll('code, pre, mjx-container, .math, script, style, p, ul, ol, table, dl')
                    .forEach(x => x.remove());
                return k.textContent.slice(0, 5000); }))})),
    widgets: views().map(s => { const p = s.previousElementSibling; const ok = drawn(s);
        const box = ok ? p.getBoundingClientRect() : null; let id = null;
        try { id = JSON.parse(s.textContent).model_id; } catch (e) {}
        return {model_id: id, drawn: ok, width: box ? box.width : 0, height: box ? box.height : 0,
            text: ok ? p.innerText.slice(0, 2000) : '',
            readouts: ok ? [...p.querySelectorAll('.widget-readout')].map(e => e.innerText.trim()) : []}; }),
    widget_state: state ? JSON.parse(state.textContent) : null,
    math: maths().map(m => ({tex: m.textContent.slice(0, 200), typeset: !!m.querySelector('mjx-container')})),
    sidebar_links: hrefs('nav.bd-docs-nav a[href]'),
    internal_links: hrefs('.prev-next-area a[href], article a[href]'),
  };
})
"""


@dataclass
class PageReport:
    """What one page showed in the browser."""

    docname: str
    url: str
    data: dict
    requests: list[Request]
    errors: list[str]
    screenshot: Path


class Visitor:
    """Opens each page once (cached) and keeps what the tests need from it."""

    def __init__(self, browser: Chromium, base_url: str, screenshots: Path = SCREENSHOTS):
        self.browser = browser
        self.base_url = base_url
        self.screenshots = screenshots
        self.reports: dict[str, PageReport] = {}
        self.fetched: dict[str, tuple[int, str]] = {}
        # A proxy from the environment must not see requests to the local server.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def page(self, docname: str) -> PageReport:
        if docname not in self.reports:
            url = self.base_url + docname + ".html"
            tab = Tab(self.browser)
            try:
                tab.navigate(url, PAGE_TIMEOUT_S)
                tab.collect()
                status = [q.status for q in tab.requests.values() if q.url == url]
                if status != [200]:
                    raise AssertionError(f"{url} answered {status}: is the book built from the "
                                         "current _toc.yml? (make render, or make book)")
                data = tab.evaluate(f"{COLLECT_JS}({int(PAGE_TIMEOUT_S * 1000)})", PAGE_TIMEOUT_S + 10)
                shot = tab.screenshot(self.screenshots / (docname.replace("/", "__") + ".jpg"))
                tab.collect()
            finally:
                tab.close()
            self.reports[docname] = PageReport(docname, url, data, list(tab.requests.values()),
                                               list(tab.errors), shot)
        return self.reports[docname]

    def search(self, word: str) -> list[str]:
        """Result links (paths relative to the book root) of the book's search page."""
        tab = Tab(self.browser)
        try:
            tab.navigate(f"{self.base_url}search.html?q={word}", PAGE_TIMEOUT_S)
            # Sphinx creates the (empty) summary at once, adds the results one by one,
            # and writes the summary's text only after the last one: wait for the text.
            links = tab.evaluate(f"""(async () => {{
                const done = () => {{
                    const summary = document.querySelector('#search-results .search-summary');
                    return summary && summary.textContent.trim().length > 0;
                }};
                const deadline = Date.now() + {int(PAGE_TIMEOUT_S * 1000)};
                while (Date.now() < deadline && !done())
                    await new Promise(r => setTimeout(r, 100));
                if (!done()) return null;
                return [...document.querySelectorAll('#search-results ul.search a[href]')].map(a => a.href);
            }})()""", PAGE_TIMEOUT_S + 10)
        finally:
            tab.close()
        if links is None:
            raise AssertionError(f"the search for {word!r} did not finish")
        return [link[len(self.base_url):].split("#")[0].split("?")[0] for link in links]

    def fetch(self, url: str) -> tuple[int, str]:
        """HTTP status and body of ``url`` (without its fragment), cached."""
        url = url.split("#")[0]
        if url not in self.fetched:
            try:
                with self.opener.open(url, timeout=30) as response:
                    self.fetched[url] = (response.status, response.read().decode(errors="replace"))
            except urllib.error.HTTPError as exc:
                self.fetched[url] = (exc.code, "")
        return self.fetched[url]


# sphinx-thebe 0.3.1 writes its configuration script twice into every page of a
# Jupyter Book 1 site; the second copy fails, harmlessly.
KNOWN_SCRIPT_ERRORS = ("Identifier 'THEBE_JS_URL' has already been declared",)


def loading_problems(report: PageReport) -> list[str]:
    """Requests to other hosts (the book must work offline), failed requests, script errors.

    The browser asks for /favicon.ico by itself; the book has none.
    """
    local = urlsplit(report.url).netloc
    web = [q for q in report.requests if urlsplit(q.url).scheme in ("http", "https")]
    problems = [f"loads from another host (blank offline): {q.url}"
                for q in web if urlsplit(q.url).netloc != local]
    problems += [f"request failed: {q.url}: {q.status or q.failure}" for q in web
                 if urlsplit(q.url).path != "/favicon.ico" and (q.failure or (q.status or 0) >= 400)]
    problems += [f"script error: {e}" for e in report.errors
                 if not any(k in e for k in KNOWN_SCRIPT_ERRORS) and "favicon.ico" not in e]
    return problems


def widget_state_errors(state: dict | None) -> list[str]:
    """Error outputs saved inside Output widgets (an interact callback that raised)."""
    found = []
    for model_id, model in ((state or {}).get("state") or {}).items():
        for output in (model.get("state") or {}).get("outputs") or []:
            if output.get("output_type") == "error":
                found.append(f"{model_id}: {output.get('ename')}: {output.get('evalue')}")
    return found


# Markdown syntax that a rendered block still shows when its Markdown was not parsed
# (a table rendered as CommonMark is a paragraph of pipes, with `---` turned into em dashes).
RAW_MARKDOWN = (
    (re.compile(r"^\s*\|"), "a line that starts with | (a table not rendered)"),
    (re.compile(r"^(?=.*\|)(?=.*[-\u2013\u2014])[\s|:\-\u2013\u2014]+$"),
     "a table rule (---|---, or em dashes)"),
    (re.compile(r"\*\*"), "literal ** (bold not rendered)"),
    (re.compile(r"`"), "a backtick (code not rendered)"),
    (re.compile(r"^\s*#{1,6}\s"), "a line that starts with # (a heading not rendered)"),
)


def raw_markdown(blocks: list[str]) -> list[str]:
    """One line per rendered text block that still shows Markdown syntax, saying which."""
    found = []
    for block in blocks:
        for line in block.splitlines():
            for pattern, what in RAW_MARKDOWN:
                if pattern.search(line):
                    found.append(f"{what}: {line.strip()[:160]!r}")
                    break
    return found


def dump(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False)[:4000]
