"""The planner's printed command run as printed on the emulated cluster (chapter 16).

``python -m ddpguide.plan`` ranks every layout ``train.py`` runs of the time check's GPT
(``checks.TIME_MODEL``, sequence 64, batch 8, float32) on the cluster's hardware, measured by
its microbenchmarks just before, and prints the ``torchrun`` lines of the first that fits:
one a node, for the cluster's 2 x 2 ranks. Those lines run on the nodes as printed
(``ddpguide.plan.command``: ``NODE0`` replaced by node 0's address, ``--steps``, ``--cost``
and ``--report`` added), and their measured median step and counted memory (the busiest
rank's parameters, gradients, AdamW state and saved activations) are set against the
planner's prediction for that layout on that hardware:
``command_step_predicted_over_measured`` and ``command_memory_predicted_over_measured``.

The ``plan`` suite measures this on its cluster, just after the hardware.
``python -m ddpguide.bench.plan_command --add FILE`` measures it alone, on a cluster of its
own with its hardware measured anew, and adds it to a saved report of the ``plan`` suite (its
measurement, its ratios and a note with its time and load); the rest of the report is kept.
``--parts trackers`` (or ``--parts command trackers``) adds the suite's
``memory_predicted_over_tracker`` ratios the same way instead (or too): torch's memory
trackers on every layout at 4 ranks (``plan.tracker.every_layout``; no cluster, no timing).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ddpguide.bench.report import Report
from ddpguide.plan import command
from ddpguide.plan.checks import TIME_BATCH, TIME_MODEL, TIME_SEQ

STEP, MEMORY = "command_step_predicted_over_measured", "command_memory_predicted_over_measured"
ANCHORS = {
    STEP: ("step predicted / measured, the layout python -m ddpguide.plan prints first, its torchrun "
           "lines run as printed on the emulated cluster (2 nodes x 2 ranks, 20mbit)", "",
           f"{command.STEP_BAND[0]}-{command.STEP_BAND[1]}"),
    MEMORY: ("parameters + gradients + AdamW state + saved activations of the same run, predicted / "
             "counted by train.py --cost at the busiest rank", "",
             f"{command.MEMORY_BAND[0]}-{command.MEMORY_BAND[1]}"),
}
#: measured by :func:`add_to`
PREFIX = "command: "


def measure(report: Report, p: ModuleType, cluster: Any, hw: Any, folder: Path, steps: int = 20) -> dict:
    """Print the plan on ``hw`` (the cluster's measured hardware), run its lines on ``cluster``
    and add the two ratios and the run to ``report``."""
    shape = dict(TIME_MODEL)
    hw_file = command.write_hardware(hw, folder / "cluster.json")
    per_node = cluster.spec.ranks_per_node
    row, lines = command.printed(p, hw_file, len(cluster.nodes) * per_node, per_node, shape, TIME_SEQ, TIME_BATCH,
                                 "float32")
    load = os.getloadavg()[0]
    cost = command.run(cluster, lines, steps=steps, folder=folder / "run")
    found = command.compared(p, row, shape, TIME_SEQ, TIME_BATCH, "float32", cost)
    report.ratios[STEP], report.ratios[MEMORY] = found["step"], found["memory"]
    report.add(f"{PREFIX}{row['name']}", found["step_measured_s"] * 1e3, "ms",
               predicted_ms=found["step_predicted_s"] * 1e3, memory_predicted=found["memory_predicted"],
               memory_counted=found["memory_measured"], lines=lines, steps=steps, load_before=load,
               load_after=os.getloadavg()[0])
    print(f"the printed command, {row['name']}: step predicted {found['step_predicted_s'] * 1e3:.0f} ms, "
          f"measured {found['step_measured_s'] * 1e3:.0f} ms ({found['step']:.2f}); memory "
          f"{found['memory']:.3f}; load {load:.1f}", flush=True)
    return found


def add_to(path: Path, folder: Path, parts: tuple[str, ...] = ("command",)) -> dict:
    """Measure ``parts`` alone: ``command`` (a cluster of the suite's shape made, its hardware
    measured, :func:`measure`), ``trackers`` (:func:`tracker.every_layout`); add them to the plan
    report saved at ``path`` (written whole), replacing what the same parts put there before."""
    from ddpguide.core.commands import write_atomically
    from ddpguide.plan import search, tracker
    from ddpguide.plan.checks import CHECK_BATCH, CHECK_SEQ, TRACKER

    saved = json.loads(path.read_text())
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load = round(os.getloadavg()[0], 2)
    report = Report("plan")
    p = search.program()
    if "command" in parts:
        from ddpguide.cluster import Spec, up
        from ddpguide.plan import measure as measuring
        from ddpguide.plan.checks import LINK, NODES, RANKS_PER_NODE

        with up(Spec(nodes=NODES, ranks_per_node=RANKS_PER_NODE, link=LINK)) as cluster:
            hw = measuring.cluster_hardware(p, cluster, folder / "hardware")
            measure(report, p, cluster, hw, folder)
        saved["measurements"] = [m for m in saved["measurements"] if not m["name"].startswith(PREFIX)]
        saved["measurements"] += report.to_dict()["measurements"]
    if "trackers" in parts:
        saved["ratios"] = {k: v for k, v in saved["ratios"].items() if not k.startswith(TRACKER)}
        report.ratios.update({f"{TRACKER}{name}": ratio for name, ratio in tracker.every_layout(
            p, CHECK_SEQ, CHECK_BATCH, say=lambda line: print(line, flush=True)).items()})
    saved["ratios"].update(report.ratios)
    for part in parts:
        first = STEP if part == "command" else TRACKER.rstrip(": ")
        saved["notes"] = [n for n in saved["notes"] if not n.startswith(f"{first}:")] + [
            f"{first}: measured alone at {at} (load {load} to {round(os.getloadavg()[0], 2)})"
            + (" on a cluster of its own with its hardware measured anew" if part == "command" else "")
            + f", by python -m ddpguide.bench.plan_command --add --parts {part}"]
    write_atomically(path, json.dumps(saved, indent=2) + "\n")
    return saved


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from ddpguide.bench.report import add_parser, saved_suite
    from ddpguide.cluster.netns import missing_prerequisite

    parser = add_parser("python -m ddpguide.bench.plan_command", __doc__.splitlines()[0], "plan")
    parser.add_argument("--parts", nargs="+", choices=("command", "trackers"), default=["command"],
                        help="what to measure and add: the printed command (root), torch's trackers")
    args = parser.parse_args(argv)
    path = saved_suite(parser, args.add, "plan")
    missing = missing_prerequisite() if "command" in args.parts else None
    if missing:
        parser.error(f"the emulated cluster: {missing}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="ddpguide-plan-command-") as tmp:
        saved = add_to(path, Path(tmp), tuple(dict.fromkeys(args.parts)))
    if "command" in args.parts:
        print(f"{STEP} {saved['ratios'][STEP]:.3f}, {MEMORY} {saved['ratios'][MEMORY]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
