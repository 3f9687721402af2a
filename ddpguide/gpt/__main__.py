"""``python -m ddpguide.gpt``: every layout of the GPT against one process, as a table."""

from __future__ import annotations

import argparse
import json
import sys

from ddpguide.gpt.layouts import LAYOUTS, equivalence_table, markdown


def main(argv: list[str] | None = None) -> int:
    names = [name for name, _, _ in LAYOUTS]
    parser = argparse.ArgumentParser(prog="python -m ddpguide.gpt", description=__doc__)
    parser.add_argument("--layout", nargs="+", choices=names, metavar="NAME",
                        help="some layouts (default: all); the one-process run is always first")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    chosen = [LAYOUTS[0]] + [entry for entry in LAYOUTS[1:]
                             if not args.layout or entry[0] in args.layout]
    import os

    load_at_start = os.getloadavg()[0]
    rows = equivalence_table(chosen, progress=lambda row: print(
        f"{row['layout']}: done in {row['seconds']:.1f} s", file=sys.stderr, flush=True))
    if args.json:
        import datetime
        import platform

        import torch

        print(json.dumps({"measured": datetime.date.today().isoformat(),
                          "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
                          "torch": torch.__version__, "load_at_start": load_at_start,
                          "load_at_end": os.getloadavg()[0], "rows": rows}, indent=1))
    else:
        print(markdown(rows))
    worst = max(max(r["loss_difference"], r["parameter_difference"]) for r in rows)
    return 0 if worst <= 1e-10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
