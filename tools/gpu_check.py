"""``make gpu-check``: every chapter and the GPU benchmarks on a machine with one GPU.

Each chapter runs first with every rank on the GPU (``DDPGUIDE_DEVICE=cuda``,
``DDPGUIDE_BACKEND=gloo``: nccl refuses two ranks on one device, gloo shares
it). gloo moves only some collectives of CUDA tensors (all-reduce and
broadcast, which is what DDP needs), so a chapter that fails that way runs
again with the package's own choice (``select_runtime``: CUDA for one rank,
gloo on CPU for several); the summary shows both results. Then the nccl paths
that CPU tests only simulate run for real (``tools/gpu_nccl_checks.py``:
``dcp.async_save`` and the CPU backend, the one-GPU-per-rank device choice, the
doctor on nccl with its sweep to 1 GiB, chapter 14's memory formulas against what CUDA's
kernels keep and ``torch.cuda.max_memory_allocated``), and the benchmark suites that a GPU
changes run in quick mode. Everything shares one time budget
(8 minutes by default); what does not fit is reported as not run.

Without a visible GPU it says so and runs nothing (exit status 0, or 1 with
``--require-gpu``). Logs and benchmark JSON go to ``_build/gpu-check/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
OUT = ROOT / "_build" / "gpu-check"
GPU_SUITES = ("ddp", "amp", "pipeline")
MODES = {
    "all ranks on cuda": {"DDPGUIDE_DEVICE": "cuda", "DDPGUIDE_BACKEND": "gloo"},
    "select_runtime": {},
}


@dataclass
class Outcome:
    """One run: what ran, how, and how it ended."""

    name: str
    mode: str
    status: str  # passed / FAILED / not run
    seconds: float = 0.0
    note: str = ""


def gpu_description() -> str | None:
    """The GPUs PyTorch sees, or None when there is none."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} GPU(s): {', '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_error(log: str) -> str:
    """The most telling line of a failed run's output."""
    lines = [ANSI.sub("", line).strip() for line in log.splitlines()]
    for line in reversed(lines):
        if line.startswith("FAILED ") and " - " in line:  # pytest's summary: the error itself
            return line.split(" - ", 1)[1][:200]
    for marker in ("Error:", "Exception:", "Timeout"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1][:200]
    tail = [line for line in lines if line]
    return tail[-1][:200] if tail else "no output"


def run(command: list[str], env_extra: dict[str, str], timeout: float, log_path: Path) -> tuple[bool, float, str]:
    """Run a command with extra environment; True when it exits 0 in time."""
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        ok, log = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        ok, log = False, out + f"\nTimeout: stopped after {timeout:.0f} s"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(log)
    return ok, time.monotonic() - start, log


def check_chapter(notebook: Path, deadline: float, per_chapter: float) -> list[Outcome]:
    outcomes = []
    for mode, env in MODES.items():
        remaining = deadline - time.monotonic()
        if remaining < 20:
            outcomes.append(Outcome(notebook.stem, mode, "not run", note="time budget spent"))
            break
        timeout = min(per_chapter, remaining)
        log_path = OUT / f"{notebook.stem}.{mode.replace(' ', '-')}.log"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
                   f"--nbmake-timeout={int(timeout)}", str(notebook.relative_to(ROOT))]
        ok, seconds, log = run(command, env, timeout + 30, log_path)
        outcomes.append(Outcome(notebook.stem, mode, "passed" if ok else "FAILED", seconds,
                                "" if ok else f"{first_error(log)} (log: {log_path.relative_to(ROOT)})"))
        if ok:
            break
    return outcomes


def check_suite(suite: str, deadline: float) -> Outcome:
    remaining = deadline - time.monotonic()
    if remaining < 20:
        return Outcome(suite, "quick", "not run", note="time budget spent")
    result = OUT / f"bench-{suite}.json"
    command = [sys.executable, "-m", "ddpguide.bench", suite, "--quick", "--json", str(result)]
    ok, seconds, log = run(command, {}, min(180.0, remaining), OUT / f"bench-{suite}.log")
    if not ok:
        return Outcome(suite, "quick", "FAILED", seconds, first_error(log))
    ratios = json.loads(result.read_text()).get("ratios", {})
    note = ", ".join(f"{k} {v:.2f}x" if isinstance(v, (int, float)) else f"{k} {v}"
                     for k, v in list(ratios.items())[:4])
    return Outcome(suite, "quick", "passed", seconds, note)


NCCL_CHECKS_S = 180.0  # kept out of the chapters' share of the budget


def check_nccl_paths(deadline: float) -> Outcome:
    remaining = deadline - time.monotonic()
    if remaining < 20:
        return Outcome("nccl paths", "one GPU", "not run", note="time budget spent")
    command = [sys.executable, "tools/gpu_nccl_checks.py"]
    ok, seconds, log = run(command, {"PYTHONPATH": str(ROOT)}, min(NCCL_CHECKS_S * 2, remaining),
                           OUT / "nccl-checks.log")
    lines = [line for line in log.splitlines() if ": ok" in line or ": FAILED" in line]
    return Outcome("nccl paths", "one GPU", "passed" if ok else "FAILED", seconds,
                   "; ".join(lines) or first_error(log))


def summary(gpus: str, chapters: list[Outcome], suites: list[Outcome], elapsed: float) -> str:
    rows = [("chapter", "mode", "result", "time", "note")]
    rows += [(o.name, o.mode, o.status, f"{o.seconds:.0f} s", o.note) for o in chapters]
    rows += [("", "", "", "", "")]
    rows += [("benchmark", "mode", "result", "time", "ratios / note")]
    rows += [(o.name, o.mode, o.status, f"{o.seconds:.0f} s", o.note) for o in suites]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"gpu-check on {gpus}", ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines += ["", f"finished in {elapsed:.0f} s; logs in {OUT.relative_to(ROOT)}/"]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 when no GPU is visible")
    args = parser.parse_args(argv)

    gpus = gpu_description()
    if gpus is None:
        print("gpu-check: no CUDA GPU is visible to PyTorch (torch.cuda.device_count() == 0), so "
              "nothing was run. Run `make gpu-check` on a machine with an NVIDIA GPU and its driver; "
              "`make test` covers the CPU paths.")
        return 1 if args.require_gpu else 0

    from ddpguide.bench import SUITES

    start = time.monotonic()
    suites = [s for s in GPU_SUITES if s in SUITES]
    # The benchmarks keep about a minute each out of the budget.
    chapters_deadline = (start + args.budget - NCCL_CHECKS_S
                         - min(60.0 * len(suites), args.budget / 3))
    notebooks = sorted((ROOT / "book").glob("*.ipynb"))
    per_chapter = max(60.0, (chapters_deadline - start) / max(1, len(notebooks)))
    chapter_outcomes: list[Outcome] = []
    for notebook in notebooks:
        chapter_outcomes += check_chapter(notebook, chapters_deadline, per_chapter * 1.5)
        print(f"  {chapter_outcomes[-1].name}: {chapter_outcomes[-1].status}", flush=True)
    chapter_outcomes.append(check_nccl_paths(chapters_deadline + NCCL_CHECKS_S))
    print(f"  nccl paths: {chapter_outcomes[-1].status}", flush=True)
    suite_outcomes = [check_suite(s, start + args.budget) for s in suites]
    print()
    print(summary(gpus, chapter_outcomes, suite_outcomes, time.monotonic() - start))
    # A chapter passes when its last run passed (the fallback counts).
    last = {o.name: o.status for o in chapter_outcomes}
    failed = [n for n, s in last.items() if s != "passed"]
    failed += [o.name for o in suite_outcomes if o.status != "passed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
