"""A small sample book, built with the book's own _config.yml, works offline.

This checks the pipeline itself, whatever the chapters contain: a notebook
that shows a widget, a formula and a figure is executed the two ways the book
is built (nbmake --overwrite then a render without execution, as ``make test``
and CI do; myst-nb executing during the build, as ``make book`` does). Both
keep the widget state in the notebook, and in the browser the page draws the
widget from that state, typesets the formula and shows the figure, with no
request leaving the local server. A Markdown table printed by a cell renders
as a table; built without the book's ``nb_render_markdown_format: gfm`` it is
a paragraph of pipes, and the check of every page says so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tests.browser.browser_support import ROOT, Visitor, loading_problems, raw_markdown, serve, unavailable
from tests.browser.cdp_client import Chromium

pytestmark = pytest.mark.timeout(600)

BOOK_JS = ROOT / "_build" / "book-js"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
BIN = Path(sys.executable).parent
# A table as the chapters print them (display(Markdown(...))).
TABLE = ("| strategy | backward |\n|---|---|\n"
         "| ddp | 1 x all-reduce (P -> B) |\n| fsdp2 | 3 x reduce-scatter (P -> S(0)) |\n")
GFM_LINE = "nb_render_markdown_format: gfm"


def write_sources(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: sample\n")
    (folder / "intro.md").write_text("# Sample book\n\nA page without code.\n")
    notebook = new_notebook(metadata={"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}})
    notebook.cells = [
        new_markdown_cell("# Sample chapter\n\nEuler: $e^{i\\pi} + 1 = 0$.\n"),
        new_code_cell("import ipywidgets as widgets\n"
                      "widgets.IntSlider(value=7, min=0, max=10, description='ranks')"),
        new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1, 2], [2, 0, 1])\nplt.show()"),
        new_code_cell(f"from IPython.display import Markdown, display\ndisplay(Markdown({TABLE!r}))"),
    ]
    nbformat.write(notebook, folder / "sample.ipynb")
    # The book's own configuration and the JavaScript it serves, as `make book` has them.
    config = (ROOT / "_config.yml").read_text()
    assert "execute_notebooks: force" in config
    (folder / "_build").mkdir()
    (folder / "_build" / "book-js").symlink_to(BOOK_JS, target_is_directory=True)
    (folder / "config_force.yml").write_text(config)
    (folder / "config_off.yml").write_text(
        config.replace("execute_notebooks: force", 'execute_notebooks: "off"'))
    # The configuration as it was before tables rendered: myst-nb's default, CommonMark.
    assert GFM_LINE in config
    (folder / "config_commonmark.yml").write_text(config.replace(GFM_LINE, ""))


def run(command: list[str], cwd: Path) -> None:
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{(proc.stdout + proc.stderr)[-5000:]}"


@pytest.fixture(scope="module", params=["nbmake-then-render", "myst-nb-executes"])
def sample_html(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (BOOK_JS / "_vendor" / "VERSIONS.json").exists():
        unavailable(f"the book's JavaScript is not fetched ({BOOK_JS}): run `make book-js`")
    folder = tmp_path_factory.mktemp(request.param) / "src"
    write_sources(folder)
    if request.param == "nbmake-then-render":
        run([str(BIN / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
             "--overwrite", "sample.ipynb"], folder)
        saved = nbformat.read(folder / "sample.ipynb", as_version=4).metadata
        assert saved.get("widgets", {}).get(WIDGET_STATE, {}).get("state"), "nbmake lost the widget state"
        config = "config_off.yml"
    else:
        config = "config_force.yml"
    run([str(BIN / "jupyter-book"), "build", ".", "--path-output", "out", "-W", "-n",
         "--keep-going", "--config", config], folder)
    return folder / "out" / "_build" / "html"


@pytest.fixture(scope="module")
def sample_server(sample_html: Path) -> Iterator[str]:
    with serve(sample_html) as url:
        yield url


def test_sample_page_works_offline(browser: Chromium, sample_server: str, tmp_path: Path):
    # Not a chapter: its screenshot is no artefact.
    report = Visitor(browser, sample_server, screenshots=tmp_path).page("sample")
    data = report.data

    widgets = data["widgets"]
    assert len(widgets) == 1 and widgets[0]["drawn"], f"widget not drawn: {widgets}"
    assert widgets[0]["height"] > 0 and "ranks" in widgets[0]["text"]
    assert widgets[0]["readouts"] == ["7"], widgets[0]
    state = data["widget_state"]["state"][widgets[0]["model_id"]]["state"]
    assert state["value"] == 7 and state["description"] == "ranks"

    assert data["math"] and all(m["typeset"] for m in data["math"]), data["math"]
    assert [img["loaded"] for img in data["images"]] == [True], data["images"]

    served = [q.url for q in report.requests]
    for script in ("_vendor/widget-setup.js", "_vendor/require.js",
                   "_vendor/html-manager/embed-amd.js", "_vendor/mathjax/tex-mml-chtml.js"):
        assert any(script in url for url in served), f"{script} not loaded: {served}"
    problems = loading_problems(report)
    assert not problems, "\n".join(problems)


def test_sample_markdown_table_renders(browser: Chromium, sample_server: str, tmp_path: Path):
    data = Visitor(browser, sample_server, screenshots=tmp_path).page("sample").data
    rendered = [block for cell in data["cells"] for block in cell["rendered"]]
    # The table's cells are blocks of their own (td), and nothing shows raw Markdown.
    assert "1 x all-reduce (P -> B)" in rendered and "strategy" in rendered, rendered
    assert raw_markdown(rendered) == [], raw_markdown(rendered)


@pytest.fixture(scope="module")
def commonmark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (BOOK_JS / "_vendor" / "VERSIONS.json").exists():
        unavailable(f"the book's JavaScript is not fetched ({BOOK_JS}): run `make book-js`")
    folder = tmp_path_factory.mktemp("commonmark") / "src"
    write_sources(folder)
    run([str(BIN / "jupyter-book"), "build", ".", "--path-output", "out", "-W", "-n",
         "--keep-going", "--config", "config_commonmark.yml"], folder)
    with serve(folder / "out" / "_build" / "html") as url:
        yield url


def test_raw_markdown_check_catches_commonmark_tables(browser: Chromium, commonmark_server: str,
                                                      tmp_path: Path):
    """Without gfm the table is one paragraph of pipes: the check of every page must fail on it."""
    data = Visitor(browser, commonmark_server, screenshots=tmp_path).page("sample").data
    found = raw_markdown([block for cell in data["cells"] for block in cell["rendered"]])
    assert any("| strategy | backward |" in f for f in found), found
    # Sphinx's smartquotes turn the rule's --- into em dashes.
    assert any("|\u2014|\u2014|" in f for f in found), found
