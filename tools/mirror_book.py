"""Copy the book's sources to a folder where the chapters can be executed.

``make test`` executes every chapter once, with nbmake, in this copy, then
renders the HTML from the copy: the notebooks in ``book/`` stay free of
outputs, and no chapter runs twice.

The copy has the layout of the repository root, so that the paths in
``_config.yml`` and ``_toc.yml`` mean the same there: it holds the top-level
files (``_toc.yml``, ``_config.yml``, ...), ``book/`` and any other folder the
table of contents refers to, and links to the folders that ``_config.yml``
names in ``html_extra_path`` / ``html_static_path``. It cannot live under
``_build/``: nbmake skips every notebook whose path contains ``_build``.
The copy ignores itself in git (its own ``.gitignore``), and this script only
ever replaces a folder that it made.

Usage: ``python tools/mirror_book.py DEST`` (``make test`` uses ``_executed``)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).absolute().parents[1]
MARKER = ".book-copy"
IGNORED = shutil.ignore_patterns(".*", "__pycache__", "_build", "*.pt", "*.pyc")


def toc_files(toc: Any) -> list[str]:
    """Every ``root`` / ``file`` entry of a Jupyter Book ``_toc.yml``, in order."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in ("root", "file"):
                if isinstance(node.get(key), str):
                    found.append(node[key])
            for value in node.values():
                if isinstance(value, (list, dict)):
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(toc)
    return found


def config_paths(config: dict) -> list[str]:
    """Relative folders that ``_config.yml`` asks Sphinx to copy into the HTML output."""
    sphinx_config = (config.get("sphinx") or {}).get("config") or {}
    paths = [*sphinx_config.get("html_extra_path", []), *sphinx_config.get("html_static_path", [])]
    return [p for p in paths if not os.path.isabs(p)]


def mirror(dest: Path, root: Path = ROOT) -> Path:
    """Replace ``dest`` with a fresh copy of the book sources under ``root``."""
    dest, root = dest.absolute(), root.absolute()
    if dest == root or dest in root.parents:
        raise ValueError(f"{dest} contains the sources; choose another folder")
    if dest.exists() and any(dest.iterdir()) and not (dest / MARKER).exists():
        raise ValueError(f"refusing to replace {dest}: it is not a copy made by this script")
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    config = yaml.safe_load((root / "_config.yml").read_text()) or {}
    folders = {"book", "_static"} | {Path(f).parts[0] for f in toc_files(toc) if len(Path(f).parts) > 1}
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    (dest / MARKER).write_text(f"a copy of {root}, made by tools/mirror_book.py\n")
    (dest / ".gitignore").write_text("*\n")
    for entry in sorted(root.iterdir()):
        if entry.is_file() and not entry.name.startswith("."):
            shutil.copy2(entry, dest / entry.name)
        elif entry.is_dir() and entry.name in folders:
            shutil.copytree(entry, dest / entry.name, ignore=IGNORED)
    for relative in config_paths(config):
        link = dest / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(root / relative, target_is_directory=True)
    return dest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        dest = mirror(Path(argv[0]))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"book sources copied to {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
