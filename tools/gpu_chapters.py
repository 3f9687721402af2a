"""Which chapters fit on a machine's GPUs with nccl (one GPU per rank): for the multi-GPU CI job.

nccl refuses two ranks on one GPU, so a chapter that starts 4 ranks cannot run on nccl on a
2-GPU machine (``select_runtime`` refuses it with one line). ``RANKS`` is the largest number of
ranks each chapter starts on one machine, read from its code; every chapter must be listed
(tests/test_workflows.py checks it).

    python tools/gpu_chapters.py --fit 2      # chapters to run with DDPGUIDE_BACKEND=nccl
    python tools/gpu_chapters.py --no-fit 2   # the rest (they run on gloo/CPU there)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
RANKS = {
    "01_spawn_ddp": 2,
    "02_collectives": 4,
    "03_torchrun": 4,
    "04_elastic": 4,
    "05_model_parallel": 2,
    "06_sbp": 4,
    "07_amp": 3,
    "08_sharded_data_parallel": 4,
    "09_tensor_parallel": 4,
    "10_debugging": 2,  # its bug programs run on gloo whatever the machine; the doctor on 2
    "11_context_parallel": 4,
    "12_mixture_of_experts": 4,
    "13_pipeline_schedules": 4,
    "14_gpt_capstone": 4,
    "15_cluster": 4,  # 2 nodes x 2 ranks, in network namespaces (root)
    "16_plan": 4,
    "17_failures": 3,  # replica groups of one process each, and a spare
    "18_slurm": 4,  # 2 Slurm nodes x 2 ranks (slurm_env.py), in network namespaces (root)
    "appendix_measurements": 1,
}


def chapters() -> list[str]:
    """The chapter notebooks, by name without suffix."""
    return sorted(path.stem for path in (ROOT / "book").glob("*.ipynb"))


def select(gpus: int, fit: bool) -> list[str]:
    """Paths of the chapters whose ranks fit (or do not fit) on ``gpus`` GPUs."""
    unknown = [name for name in chapters() if name not in RANKS]
    if unknown:
        raise SystemExit(f"gpu_chapters: no rank count for {', '.join(unknown)} in RANKS")
    return [f"book/{name}.ipynb" for name in chapters() if (RANKS[name] <= gpus) == fit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--fit", type=int, metavar="GPUS")
    group.add_argument("--no-fit", type=int, metavar="GPUS")
    args = parser.parse_args(argv)
    gpus = args.fit if args.fit is not None else args.no_fit
    if gpus < 0:
        parser.error(f"the GPU count must be >= 0, got {gpus}")
    print(" ".join(select(gpus, fit=args.fit is not None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
