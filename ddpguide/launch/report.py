"""What a program reports with ``--report FILE``: its checks and its measured values, as JSON.

The ``check: ... OK`` lines a program prints are for the reader; the package reads the
report. Rank 0 writes it whole (a temporary file, then ``os.replace``), so a file that
exists is complete. Its one required key is ``checks``: a list of objects, each with a
``name`` and ``ok`` (true or false), one for each check the program printed. The other
keys are the program's own counts (bytes, work per rank, costs, times), named in the
program's docstring.

A report exists only once the program has finished. Where the package must follow a program
while it runs (start a second agent once an epoch is done, kill a rank at a step, time the
gap a failure leaves), the program also appends a live log to a file it is given
(``elastic_train.py --epoch-log``, ``ft_train.py --rows``): one JSON object a line, each
line in one write. It is progress, read as it grows, only with :func:`read_log`; what the
program has to say about the run as a whole goes in its report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class ReportError(RuntimeError):
    """The program wrote no report, or one that is not a report."""


def read(path: str | os.PathLike, what: str = "the program") -> dict:
    """The report at ``path``; :class:`ReportError` (one line) if it is missing or malformed."""
    path = Path(path)
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{what} wrote no report at {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ReportError(f"{what}: the report {path} is not JSON ({error})") from None
    problem = _problem(found)
    if problem:
        raise ReportError(f"{what}: the report {path} {problem}")
    return found


def _problem(found: object) -> str | None:
    if not isinstance(found, dict):
        return f"holds a {type(found).__name__}, not an object"
    checks = found.get("checks")
    if not isinstance(checks, list):
        return "has no list of checks"
    for i, check in enumerate(checks):
        if not (isinstance(check, dict) and isinstance(check.get("name"), str)
                and isinstance(check.get("ok"), bool)):
            return f"check {i} is not an object with a name and ok (true or false): {check!r}"
    return None


def failed(report: dict) -> list[str]:
    """The names of the checks that failed."""
    return [check["name"] for check in report["checks"] if not check["ok"]]


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of the live log at ``path`` so far, in the order written: one object a
    complete line; none while the file does not exist. A line still being written (no
    newline yet) is left out, and so is one that is not a JSON object: a line a kill cut
    short, which the next line written (a restarted process appends to the same file)
    continues."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.split("\n")[:-1]:
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            records.append(found)
    return records
