"""Chapter 15 opened where namespaces cannot be made: one line says why, the saved run shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

BOOK = Path(__file__).resolve().parents[2] / "book"
pytestmark = pytest.mark.multiprocess  # a kernel


def test_without_tc_the_chapter_says_so_and_runs_on_the_saved_bench(monkeypatch):
    # tc lives in /usr/sbin: a PATH without the sbin folders is a machine without iproute2's tc
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "sbin" not in p)
    monkeypatch.setenv("PATH", path)
    assert shutil.which("tc") is None
    notebook = nbformat.read(BOOK / "15_cluster.ipynb", as_version=4)
    NotebookClient(notebook, timeout=120, resources={"metadata": {"path": str(BOOK)}}).execute()
    first = next(c for c in notebook.cells if c.cell_type == "code")
    text = "".join(o.get("text", "") for o in first.outputs)
    assert text.splitlines()[0] == ("not live (tc not found: install iproute2 (apt-get install "
                                    "iproute2, or dnf install iproute)); the saved run follows")
    assert "saved bench run: " in text
