"""``python -m ddpguide.bench SUITE [--quick] [--json FILE]``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ddpguide.bench import SUITES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpguide.bench",
        description="Measure, side by side in one run, what a chapter claims.",
    )
    parser.add_argument("suite", choices=[*SUITES, "all"],
                        help="which suite: " + "; ".join(f"{k}: {v}" for k, v in SUITES.items()))
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    names = list(SUITES) if args.suite == "all" else [args.suite]
    reports = []
    for name in names:
        module = importlib.import_module(f"ddpguide.bench.{name}")
        report = module.run(quick=args.quick)
        print(report.table(), flush=True)
        print()
        reports.append(report)
    if args.json:
        payload = reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports]
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
