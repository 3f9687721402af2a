"""What a directory holds, byte for byte: the proof that bad input changed nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(directory: str | Path) -> dict[str, str]:
    """Every entry below ``directory`` (hidden ones too): relative name -> sha256 of its
    bytes, ``"<dir>"`` for a folder. Two equal snapshots mean nothing was written,
    created, removed or moved."""
    directory = Path(directory)
    out = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_dir():
            out[name] = "<dir>"
        elif path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[name] = "<other>"
    return out
