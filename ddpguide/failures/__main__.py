"""``python -m ddpguide.failures run|chaos FOLDER [options]``: chapter 17's job (torchft's
lighthouse, one torchrun per replica group), with chaos from outside for ``chaos``; the
report in FOLDER/report.json; exit status 0 exactly when every invariant holds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpguide.failures import chaos, engine
from ddpguide.failures.run import run
from ddpguide.launch import report as contract


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m ddpguide.failures", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("run", "chaos"))
    parser.add_argument("folder", help="a new folder for the rows, torchrun's logs and the report")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--failures", type=int, default=3, help="chaos: how many (default 3)")
    parser.add_argument("--kinds", default=",".join(chaos.KINDS),
                        help=f"chaos: comma-separated, of {','.join(chaos.KINDS)}")
    parser.add_argument("--max-restarts", type=int, default=5)
    parser.add_argument("--state-mb", type=int, default=0,
                        help="more float64 state per rank that every heal moves (MB)")
    parser.add_argument("--deadline", type=float, default=180.0)
    parser.add_argument("--cluster", default="", help="a live cluster's id (python -m "
                        "ddpguide.cluster up): a group a node, the lighthouse on node 0")
    args = parser.parse_args(argv)
    settings = engine.Settings(groups=args.groups, group_size=args.group_size, steps=args.steps,
                               step_seconds=args.step_seconds, seed=args.seed,
                               max_restarts=args.max_restarts, deadline_s=args.deadline,
                               state_mb=args.state_mb,
                               cluster=args.cluster)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    folder = Path(args.folder)
    problem = settings.problem()
    if problem is None and (not kinds or not set(kinds) <= set(chaos.KINDS)):
        problem = f"--kinds {args.kinds}: each one of {','.join(chaos.KINDS)}"
    if problem is None and kinds == ("link",) and not args.cluster:
        problem = "--kinds link: a link is cut on a cluster only (give --cluster ID)"
    if problem is None and kinds == ("donor",) and args.groups < 3:   # else left out, as two
        problem = (f"--kinds {args.kinds}: a donor is killed with 3 groups or more (one more "
                   "live peer to heal from)")
    if problem is None and args.failures < 0:
        problem = f"--failures {args.failures}: 0 or more"
    if problem is None and folder.exists():
        problem = f"{folder} exists: name a new folder"
    if problem is None and not folder.absolute().parent.is_dir():
        problem = f"{folder}: no such directory {folder.absolute().parent}"
    if problem is not None:
        parser.error(problem)
    engine.on_sigterm()
    report = run(settings, folder, args.failures if args.mode == "chaos" else 0, args.seed, kinds)
    for failure in report["failures"]:
        print(f"{failure['time'] - report['start']:6.1f} s  step {failure['step']:3d}  "
              f"{failure['what']}  groups {failure['groups']}  pids {failure['pids']}")
    for check in report["checks"]:
        print(f"check: {check['name']} {'OK' if check['ok'] else 'FAILED'}"
              + "".join(f"\n  {p}" for p in check["problems"][:5]))
    return 1 if contract.failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
