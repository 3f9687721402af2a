"""Fetch the JavaScript that the HTML book serves itself, so that it needs no CDN.

By default Jupyter Book pages load ``require.js`` and the widget manager
``embed-amd.js`` (for ipywidgets) and MathJax (for math) from public CDNs, so
widgets stay blank and formulas stay raw TeX offline. This script takes them
from the npm registry with ``npm pack`` (pinned versions, checked against their
published sha512 integrity) and unpacks what the pages use into
``DEST/_vendor/``, beside ``tools/widget_setup.js`` (as ``widget-setup.js``).
``_config.yml`` lists ``DEST`` in ``html_extra_path``, so Sphinx copies
``_vendor/`` to the root of the HTML output, and points ``nb_ipywidgets_js``
and ``mathjax_path`` there.

Usage: ``python tools/fetch_book_js.py _build/book-js``
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUBDIR = "_vendor"
MARKER = "VERSIONS.json"
HERE = Path(__file__).absolute().parent
# Our own script, copied beside the packages (as widget-setup.js).
OWN_FILES = ("widget_setup.js",)


@dataclass(frozen=True)
class Package:
    """An npm package, pinned, and which of its files the book serves where."""

    name: str
    version: str
    integrity: str
    source: str  # folder inside the tarball
    patterns: tuple[str, ...]  # paths under ``source`` (fnmatch patterns)
    target: str  # folder under _vendor/

    def wanted(self, member: str) -> str | None:
        """Where ``member`` of the tarball goes under _vendor/, or None to skip it."""
        if not member.startswith(self.source):
            return None
        relative = member[len(self.source):]
        if ".." in Path(relative).parts:
            return None
        if any(fnmatch.fnmatchcase(relative, p) for p in self.patterns):
            return f"{self.target}/{relative}" if self.target else relative
        return None


PACKAGES = (
    Package("requirejs", "2.3.8",
            "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
            "package/", ("require.js",), ""),
    # html-manager 1.x renders the widget state that ipywidgets 8 saves; embed-amd.js
    # loads its icon fonts from beside itself.
    Package("@jupyter-widgets/html-manager", "1.0.15",
            "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
            "package/dist/", ("embed-amd.js", "*.woff2", "*.woff", "*.ttf", "*.eot", "*.svg"),
            "html-manager"),
    # MathJax loads its fonts and the TeX extensions it meets from beside itself.
    Package("mathjax", "3.2.2",
            "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
            "package/es5/", ("tex-mml-chtml.js", "output/chtml/fonts/woff-v2/*",
                             "input/tex/extensions/*"), "mathjax"),
)
HINT = (
    "The HTML book serves require.js, the ipywidgets manager and MathJax itself (no CDN) and "
    "fetches them once from the npm registry with npm (Node.js): install Node.js and npm "
    "(Debian: apt-get install nodejs npm) and check that `npm view requirejs version` works."
)


class FetchError(RuntimeError):
    """The JavaScript could not be fetched; the message says why."""


def _npm_pack(spec: str, workdir: Path) -> dict:
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError("npm was not found on PATH.")
    proc = subprocess.run(
        [npm, "pack", spec, "--json", "--pack-destination", str(workdir)],
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        raise FetchError(f"`npm pack {spec}` failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)[0]


def fetch(dest: Path) -> Path:
    """Make sure ``dest/_vendor`` holds the pinned files and our own; return that folder."""
    target = dest / SUBDIR
    pins = {p.name: p.version for p in PACKAGES}
    marker = target / MARKER
    if not (marker.exists() and json.loads(marker.read_text()) == pins):
        _fetch_packages(dest, target, pins)
    for name in OWN_FILES:
        shutil.copyfile(HERE / name, target / name.replace("_", "-"))
    return target


def _fetch_packages(dest: Path, target: Path, pins: dict[str, str]) -> None:
    staging = dest / (SUBDIR + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _unpack_into(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / MARKER).write_text(json.dumps(pins, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _unpack_into(staging: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for package in PACKAGES:
            info = _npm_pack(f"{package.name}@{package.version}", Path(tmp))
            if info.get("integrity") != package.integrity:
                raise FetchError(f"{package.name}@{package.version}: integrity "
                                 f"{info.get('integrity')} is not the pinned {package.integrity}")
            with tarfile.open(Path(tmp) / info["filename"]) as tar:
                for member in tar.getmembers():
                    where = package.wanted(member.name) if member.isfile() else None
                    if where is None:
                        continue
                    data = tar.extractfile(member)
                    assert data is not None
                    out = staging / where
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data.read())
            first = package.wanted(package.source + package.patterns[0])
            if first is None or not (staging / first).is_file():
                raise FetchError(f"{package.name}@{package.version} has no {package.patterns[0]}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        target = fetch(Path(argv[0]))
    except (FetchError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: could not fetch the book's JavaScript: {exc}\n{HINT}", file=sys.stderr)
        return 1
    print(f"the book's JavaScript is in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
