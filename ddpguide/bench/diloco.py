"""DiLoCo against DDP at equal samples (chapter 17): what a sync every H steps costs in loss.

``book/programs/diloco_digits.py``: 2 replica groups (threads of one process, torchft's
Manager and lighthouse), scikit-learn's digits, the same model, batches and inner AdamW lr for
torchft's DDP and torchft's DiLoCo (outer SGD with Nesterov momentum, lr 0.7, momentum 0.9),
every group taking the same number of inner steps of the same batch size.

- ``diloco_loss_over_ddp_loss_h<H>``: DiLoCo's held-out loss after the last step over DDP's,
  median over seeds (the program's --seed: its split, initial weights and batches).
- ``diloco_bytes_over_ddp_times_h``: the bytes given to Manager.allreduce per inner step by
  DiLoCo over DDP's, times H (every H of the run).
- ``diloco_h1_lr1_gap``: DiLoCo with H = 1, outer SGD lr 1 and no momentum, SGD inside,
  against DDP with SGD: the largest parameter difference (the program checks it is < 1e-12).
"""

from __future__ import annotations

import statistics

from ddpguide.bench.report import Report, spread_of
from ddpguide.launch import programs

PROGRAM = "diloco_digits.py"
SYNC_EVERY = (1, 5, 20)

#: the appendix's anchors for this suite: (what, reference, goal)
ANCHORS = {
    **{f"diloco_loss_over_ddp_loss_h{h}": (
        f"DiLoCo's held-out loss / DDP's at equal samples, H = {h}: digits, inner AdamW lr 3e-3, "
        "outer Nesterov lr 0.7 momentum 0.9, median over seeds",
        "Douillard et al. 2023: about 1 at H = 500 on C4, 8 groups", "what H costs (> 1)")
       for h in SYNC_EVERY},
    "diloco_bytes_over_ddp_times_h": ("DiLoCo's bytes per inner step / DDP's x H", "", "1.00 +- 1e-9"),
    "diloco_h1_lr1_gap": ("largest parameter difference, DiLoCo H = 1 outer lr 1 no momentum "
                          "(SGD inside) vs DDP (SGD)", "", "< 1e-12"),
}


def arguments(seed: int, steps: int, sync_every: tuple[int, ...] = SYNC_EVERY) -> list[str]:
    return ["--seed", str(seed), "--steps", str(steps),
            "--sync-every", *map(str, sync_every), "--lr", "3e-3"]


def ratios_of(reports: list[dict], sync_every: tuple[int, ...] = SYNC_EVERY) -> dict[str, list[float]]:
    """Each ratio's values over the reports of several seeds."""
    found: dict[str, list[float]] = {f"diloco_loss_over_ddp_loss_h{h}": [] for h in sync_every}
    found["diloco_bytes_over_ddp_times_h"] = []
    found["diloco_h1_lr1_gap"] = []
    for report in reports:
        ddp = report["ddp"]["bytes_per_inner_step"]
        for h in sync_every:
            found[f"diloco_loss_over_ddp_loss_h{h}"].append(report[f"diloco_loss_over_ddp_loss_h{h}"])
            found["diloco_bytes_over_ddp_times_h"].append(
                report[f"diloco_h{h}"]["bytes_per_inner_step"] * h / ddp)
        found["diloco_h1_lr1_gap"].append(report["exact_gap"])
    return found


def run(quick: bool = False) -> Report:
    report = Report("diloco")
    seeds, steps = ((0,), 100) if quick else ((0, 1, 2), 400)
    done = [programs.run(PROGRAM, *arguments(seed, steps), report=True, echo=False, timeout=300.0)
            for seed in seeds]
    for seed, ran in zip(seeds, done):
        found = ran.report or {}
        report.add(f"seed {seed}: DDP held-out loss", found["ddp"]["loss"], "nats",
                   steps=steps, groups=found["groups"], batch=found["batch"])
        for h in SYNC_EVERY:
            report.add(f"seed {seed}: DiLoCo H={h} held-out loss", found[f"diloco_h{h}"]["loss"], "nats")
    for name, series in ratios_of([ran.report or {} for ran in done]).items():
        report.ratios[name] = max(series) if name.endswith("_gap") else statistics.median(series)
        if len(series) > 1 and name.startswith("diloco_loss"):
            report.spreads[name] = spread_of(series)
    report.notes.append(
        f"{PROGRAM} --seed S {' '.join(arguments(0, steps)[2:])} for S in {', '.join(map(str, seeds))}: 2 replica "
        "groups as threads of one process, batch 32 each; the held-out loss is group 0's after the "
        "last step. The program exits 1 when one of its checks fails, which stops the suite.")
    return report

