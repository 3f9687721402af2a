"""The nccl paths that a CPU can only simulate, checked on one real GPU (part of ``make gpu-check``).

1. ``dcp.async_save`` refuses an nccl-only group with its exact message, and saves and loads a
   CUDA tensor in a ``"cpu:gloo,cuda:nccl"`` group (what ``dcp_reshard.py`` starts on GPUs).
2. A rank that ``CUDA_VISIBLE_DEVICES`` leaves one GPU (8 local ranks) gets ``cuda:0`` and nccl
   from ``select_runtime`` and from ``dcp_reshard.py``'s ``rank_device()``.
3. The doctor with one rank on the GPU: nccl, its version printed, the sweep to 1 GiB.
4. Chapter 14's memory formulas on CUDA (``train.py --cost`` on one GPU, with each attention
   kernel SDPA picks there: efficient in float32, flash with ``--bf16``, math with grouped-query
   attention in float32): what autograd keeps within 2% of the CUDA branch's prediction, and
   ``torch.cuda.max_memory_allocated`` above the step's start set beside the predicted
   gradients, activations and FSDP2 copies (:func:`judge_memory`).

Prints one line per check (``ok`` / ``FAILED``) and exits 1 if any failed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
REFUSAL = ("A CPU backend must be enabled for async save; try initializing process group with "
           "'cpu:gloo,cuda:nccl'")


def check_async_save() -> str:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", rank=0, world_size=1)
        try:
            dcp.async_save({"w": torch.ones(2, device="cuda")}, checkpoint_id=f"{folder}/a")
            return "nccl-only group: async_save did not refuse"
        except AssertionError as error:
            if str(error) != REFUSAL:
                return f"nccl-only group: unexpected message {error}"
        finally:
            dist.destroy_process_group()
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        try:
            weights = torch.arange(6.0, device="cuda")
            dcp.async_save({"w": weights}, checkpoint_id=f"{folder}/b").result(timeout=120)
            loaded = {"w": torch.zeros(6, device="cuda")}
            dcp.load(loaded, checkpoint_id=f"{folder}/b")
            if not torch.equal(loaded["w"], weights):
                return "cpu:gloo,cuda:nccl: loaded tensor differs"
        finally:
            dist.destroy_process_group()
    return ""


def check_one_gpu_per_rank() -> str:
    os.environ.update(LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", CUDA_VISIBLE_DEVICES="0")
    from ddpguide.core.runtime import select_runtime

    runtime = select_runtime(8)
    spec = importlib.util.spec_from_file_location("dcp_reshard", ROOT / "book/programs/dcp_reshard.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    got = (runtime.backend, str(runtime.device(5)), str(program.rank_device()))
    return "" if got == ("nccl", "cuda:0", "cuda:0") else f"got {got}"


def check_doctor() -> str:
    done = subprocess.run([sys.executable, "-m", "ddpguide.doctor", "--nproc", "1", "--timeout", "60"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-200:]
    if done.returncode != 0 or " 1 GiB " not in done.stdout or " nccl " not in done.stdout:
        return f"exit {done.returncode}: {summary}"
    print(done.stdout, flush=True)
    return ""


MEMORY_RUNS = {"efficient": (), "flash": ("--bf16",), "math": ("--kv-heads", "2")}


def judge_memory(kernel: str, cost: dict) -> str:
    """The problem with one ``--cost`` run on CUDA ('' if none): the kernel the prediction
    assumed, the saved bytes against the prediction (2%), and an allocator peak that holds
    at least the saved activations (it also holds what is not predicted: the gradients of
    the activations, the logits, the allocator's rounding)."""
    predicted, measured = cost["predicted"]["memory"][0], cost["memory"][0]
    if (cost["predicted"]["device"], cost["predicted"]["attention"]) != ("cuda", kernel):
        return f"{kernel}: predicted for {cost['predicted']['device']}, {cost['predicted']['attention']}"
    ratio = measured["activations"] / predicted["activations"]
    if not 0.98 <= ratio <= 1.02:
        return f"{kernel}: activations measured / predicted {ratio:.3f}"
    growth = measured["cuda_peak_growth"]
    if growth is None or growth < measured["activations"]:
        return f"{kernel}: max_memory_allocated grew {growth} B, below the {measured['activations']} B kept"
    expected = predicted["gradients"] + predicted["activations"] + predicted["unsharded"]
    print(f"{kernel}: activations {ratio:.3f} of predicted; allocator peak above the start "
          f"{growth / expected:.2f} x predicted gradients + activations + unsharded", flush=True)
    return ""


def check_memory() -> str:
    import json

    problems = []
    for kernel, options in MEMORY_RUNS.items():
        with tempfile.TemporaryDirectory() as folder:
            done = subprocess.run([sys.executable, str(ROOT / "book/programs/gpt/train.py"), "--steps", "3",
                                   "--cost", "--report", f"{folder}/r.json", *options], cwd=folder,
                                  capture_output=True, text=True, timeout=240)
            if done.returncode != 0:
                problems.append(f"{kernel}: exit {done.returncode}: {done.stderr.strip()[-200:]}")
                continue
            print("\n".join(line for line in done.stdout.splitlines() if line.startswith("cost ")))
            problems.append(judge_memory(kernel, json.loads(Path(f"{folder}/r.json").read_text())["cost"]))
    return "; ".join(p for p in problems if p)


CHECKS = {"async_save and the CPU backend": check_async_save,
          "one GPU per rank (CUDA_VISIBLE_DEVICES)": check_one_gpu_per_rank,
          "doctor on one GPU (nccl, to 1 GiB)": check_doctor,
          "chapter 14's memory on CUDA (three attention kernels)": check_memory}


def main() -> int:
    if len(sys.argv) == 2:  # one check, in a process of its own
        problem = CHECKS[sys.argv[1]]()
        print(problem or "ok")
        return 1 if problem else 0
    failed = 0
    for name in CHECKS:
        done = subprocess.run([sys.executable, __file__, name], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        last = (done.stdout.strip().splitlines() or [done.stderr.strip()[-200:]])[-1]
        ok = done.returncode == 0
        failed += not ok
        print(f"{name}: {'ok' if ok else 'FAILED: ' + last}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
