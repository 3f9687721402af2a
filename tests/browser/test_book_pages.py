"""Every page of the table of contents, as a reader sees it in a browser.

For each page: it loads from the local server with no failed request, no
request to another host (the book works offline) and no script error; no
executed output shows a traceback or an error; every image loads; every link
in the sidebar, in the previous/next buttons and in the text resolves (and
its anchor exists); the search page finds the page by a word of its title;
each widget is drawn from its saved state; each formula is typeset; no output
rendered from Markdown still shows Markdown syntax (a table as a paragraph of
pipes, literal ``**``, backticks or ``#``).

Cells that show an error on purpose carry the tag ``raises-exception`` (the
cell raises) or ``shows-error`` (the cell prints one).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urlsplit

import pytest

from tests.browser.browser_support import (
    PageReport,
    Visitor,
    dump,
    loading_problems,
    raw_markdown,
    toc_pages,
    widget_state_errors,
)

pytestmark = pytest.mark.timeout(300)

EXPECTED_ERROR_TAGS = {"raises-exception", "shows-error"}
# An error name in a stderr output: ValueError, RuntimeError, Error:, ...
STDERR_ERROR = re.compile(r"\b\w*(Error|Exception)\b")
TRACEBACK = "Traceback (most recent call last)"
# Sphinx's English stop words (sphinx/search/en.py): the search ignores them.
STOP_WORDS = set("""a and are as at be but by for if in into is it near no not of on or such
that the their then there these they this to was will with""".split())


def report(visitor: Visitor, page: str) -> PageReport:
    return visitor.page(page)


def test_every_toc_page_is_in_the_sidebar(visitor: Visitor):
    pages = toc_pages()
    root = report(visitor, pages[0])
    linked = {urlsplit(href).path.lstrip("/") for href in root.data["sidebar_links"]}
    missing = [p for p in pages if p + ".html" not in linked]
    assert not missing, (f"pages in _toc.yml but not in the built sidebar (rebuild the book?): "
                         f"{missing}; sidebar: {sorted(linked)}")


def test_page_loads_offline_without_errors(visitor: Visitor, page: str):
    r = report(visitor, page)
    assert r.data["title"], f"{r.url} has no <h1> title"
    document = [q for q in r.requests if q.url.split("#")[0] == r.url]
    assert document and document[0].status == 200, f"{r.url}: {document}"
    problems = loading_problems(r)
    assert not problems, f"{page}:\n" + "\n".join(problems)
    assert r.screenshot.stat().st_size > 0


def test_outputs_show_no_error(visitor: Visitor, page: str):
    r = report(visitor, page)
    problems = []
    for cell in r.data["cells"]:
        if EXPECTED_ERROR_TAGS & set(cell["tags"]):
            continue
        where = f"the cell that starts {cell['source']!r}"
        for output in cell["outputs"]:
            text, kinds = output["text"], set(output["kinds"])
            if kinds & {"traceback", "error"}:
                problems.append(f"{where}: an error output:\n{text[:1500]}")
            elif TRACEBACK in text:
                problems.append(f"{where}: a traceback in its output:\n{text[:1500]}")
            elif "stderr" in kinds and STDERR_ERROR.search(text):
                problems.append(f"{where}: an error on stderr:\n{text[:1500]}")
    problems += widget_state_errors(r.data["widget_state"])
    assert not problems, (f"{page}: outputs with errors (tag the cell raises-exception or "
                          f"shows-error if that is the point):\n" + "\n\n".join(problems))


def test_outputs_show_no_raw_markdown(visitor: Visitor, page: str):
    r = report(visitor, page)
    problems = [f"the cell that starts {cell['source']!r}: {found}"
                for cell in r.data["cells"] for found in raw_markdown(cell["rendered"])]
    assert not problems, (f"{page}: outputs that show Markdown syntax instead of rendering it "
                          f"(is nb_render_markdown_format: gfm in _config.yml?):\n" + "\n".join(problems))


def test_images_load(visitor: Visitor, page: str):
    r = report(visitor, page)
    broken = [img["src"][:200] for img in r.data["images"] if not img["loaded"]]
    assert not broken, f"{page}: images that did not load: {broken}"


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.ids.update(value for name, value in attrs if name in ("id", "name") and value)


def test_links_resolve(visitor: Visitor, page: str):
    r = report(visitor, page)
    base = urlsplit(visitor.base_url)
    links = [link for link in {*r.data["sidebar_links"], *r.data["internal_links"]}
             if urlsplit(link).netloc == base.netloc]
    assert r.data["sidebar_links"], f"{page} has no table of contents in its sidebar"
    broken = []
    for link in sorted(links):
        status, body = visitor.fetch(link)
        if status != 200:
            broken.append(f"{link}: HTTP {status}")
            continue
        fragment = urlsplit(link).fragment
        if fragment:
            parser = _Ids()
            parser.feed(body)
            if fragment not in parser.ids:
                broken.append(f"{link}: no element with id {fragment!r}")
    assert not broken, f"{page}: links that do not resolve: {broken}"


def search_word(title: str) -> str:
    """The longest word of a title that Sphinx's search indexes."""
    words = [w for w in re.findall(r"[A-Za-z][A-Za-z0-9]+", title)
             if len(w) >= 3 and w.lower() not in STOP_WORDS]
    assert words, f"no searchable word in the title {title!r}"
    return max(words, key=len)


def test_search_finds_page(visitor: Visitor, page: str):
    r = report(visitor, page)
    word = search_word(r.data["title"])
    results = visitor.search(word)
    assert page + ".html" in results, f"searching {word!r} does not list {page}: {results}"


def test_widgets_render_saved_state(visitor: Visitor, page: str):
    r = report(visitor, page)
    widgets = r.data["widgets"]
    if not widgets:
        pytest.skip(f"{page} shows no widgets")
    state = (r.data["widget_state"] or {}).get("state") or {}
    problems = []
    for w in widgets:
        model = (state.get(w["model_id"]) or {}).get("state")
        if model is None:
            problems.append(f"{w['model_id']}: no saved state on the page")
        elif not w["drawn"] or w["width"] <= 0 or w["height"] <= 0:
            problems.append(f"{w['model_id']}: not drawn: {dump(w)}")
        elif "Error displaying widget" in w["text"] or "Error creating widget" in w["text"]:
            problems.append(f"{w['model_id']}: {w['text'][:300]}")
        else:
            if model.get("description") and model["description"] not in w["text"]:
                problems.append(f"{w['model_id']}: description {model['description']!r} not shown")
            if model.get("_model_name") == "IntSliderModel" and model.get("readout", True):
                if str(model["value"]) not in w["readouts"]:
                    problems.append(f"{w['model_id']}: shows {w['readouts']}, saved value {model['value']}")
    assert not problems, f"{page}: widgets:\n" + "\n".join(problems)


def test_math_is_typeset(visitor: Visitor, page: str):
    r = report(visitor, page)
    if not r.data["math"]:
        pytest.skip(f"{page} has no math")
    raw = [m["tex"] for m in r.data["math"] if not m["typeset"]]
    assert not raw, f"{page}: formulas MathJax did not typeset: {raw}"
