"""``python -m ddpguide.bench SUITE [--quick] [--json FILE]``.

Every input is checked before a suite starts (a suite runs for minutes): a bad
one is one line naming the option and the value, exit status 2, nothing written.
While a suite runs, its progress and each figure go to stderr
(:mod:`ddpguide.bench.progress`); Ctrl-C prints what was measured so far and exits
with status 130, writing no JSON.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
from types import ModuleType

from ddpguide.bench import SUITES
from ddpguide.bench.report import check_report_file
from ddpguide.core.commands import InputError, OneLineParser, write_atomically

PROG = "python -m ddpguide.bench"
CHOICES = (*SUITES, "all")


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog=PROG,
                           description="Measure, side by side in one run, what a chapter claims.")
    parser.add_argument("suite", metavar="SUITE",
                        help="which suite: " + "; ".join(f"{k}: {v}" for k, v in SUITES.items())
                        + "; all: every suite")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the results as JSON (missing folders are made; an "
                             "existing file is replaced only if it is a benchmark report)")
    return parser


def load_suite(name: str) -> ModuleType:
    """The module of suite ``name``: it has ``run(quick: bool) -> Report``."""
    return importlib.import_module(f"ddpguide.bench.{name}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.suite not in CHOICES:
            # Checked here, not by argparse's choices: its quoting changes across Python versions.
            raise InputError("SUITE", f"invalid choice: {args.suite!r} (choose from "
                                      f"{', '.join(CHOICES)})")
        if args.json is not None:
            check_report_file(args.json, "--json")
    except InputError as exc:
        parser.error(str(exc))

    names = list(SUITES) if args.suite == "all" else [args.suite]
    reports = []
    for name in names:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        load_at_start = round(os.getloadavg()[0], 2)
        try:
            report = load_suite(name).run(quick=args.quick)
        except KeyboardInterrupt:  # the suite has printed what it measured so far
            print(f"{PROG} {name}: interrupted", file=sys.stderr)
            return 130
        # A suite makes its report when it is done: the run's own start is what counts.
        report.measured_at, report.load_at_start = started, load_at_start
        report.load_at_end = round(os.getloadavg()[0], 2)
        print(report.table(), flush=True)
        print()
        reports.append(report)
    if args.json:
        payload = reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports]
        write_atomically(args.json, json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
