"""The GPU a rank would use, looked at before the job starts: memory, other processes, a matmul.

For each rank that would run on a GPU (nccl), :func:`gpu_health` records:

* the compute processes ``nvidia-smi`` lists on that GPU (when ``nvidia-smi`` is on
  ``PATH``), asked first, before this process creates a CUDA context of its own;
* its free and total memory (``torch.cuda.mem_get_info``);
* the relative error of a 256 x 256 float64 matmul on the GPU against the same product
  on the CPU (float64 leaves no room for TF32 or reduced-precision paths: a large error
  means a faulty GPU, driver or clock).

Rank 0 judges the records (``consistency.gpu_health_problems``). On simulated GPUs
(``DDPGUIDE_DOCTOR_FAKE_GPUS``) the same path runs on the CPU: ``nvidia-smi`` is
asked if one is on ``PATH`` (a test puts a script there), memory and the matmul's
error come from ``DDPGUIDE_DOCTOR_FAKE_GPU_STATE`` (``free=2G,total=80G,matmul_error=0.5``;
absent keys: all memory free, the matmul computed on the CPU against itself).
None of this has run on a real GPU here.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Mapping

import torch

from ddpguide.doctor.options import parse_size

#: Simulated GPUs' state: ``free=SIZE,total=SIZE,matmul_error=X`` (sizes as ``--sizes`` reads them).
FAKE_STATE_VARIABLE = "DDPGUIDE_DOCTOR_FAKE_GPU_STATE"
MATMUL_SIZE = 256
NVIDIA_SMI_TIMEOUT_S = 10.0


def same_gpu(a: str, b: str) -> bool:
    """Whether two GPU identities name one GPU (``GPU-`` prefix and case aside)."""
    def norm(text: str) -> str:
        text = text.strip().lower()
        return text[4:] if text.startswith("gpu-") else text
    return norm(a) == norm(b)


def gpu_processes(gpu_id: str) -> list[dict[str, Any]] | None:
    """The compute processes ``nvidia-smi`` lists on ``gpu_id`` (None: no nvidia-smi, or it failed)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    found = []
    for line in done.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 4 and parts[1].isdigit() and same_gpu(parts[0], gpu_id):
            used = int(parts[3]) if parts[3].isdigit() else None
            found.append({"pid": int(parts[1]), "name": parts[2], "used_mib": used})
    return found


def matmul_error(device: torch.device) -> float:
    """Largest |GPU - CPU| of a fixed float64 matmul, over the largest |CPU| entry."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator, dtype=torch.float64)
            for _ in range(2))
    expected = a @ b
    got = (a.to(device) @ b.to(device)).cpu()
    return float((got - expected).abs().max() / expected.abs().max())


def fake_state(environ: Mapping[str, str]) -> dict[str, float]:
    """Simulated GPUs' state from :data:`FAKE_STATE_VARIABLE` (ValueError when malformed)."""
    state: dict[str, float] = {}
    for item in filter(None, environ.get(FAKE_STATE_VARIABLE, "").split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in ("free", "total", "matmul_error"):
            raise ValueError(f"{FAKE_STATE_VARIABLE}: unknown key {key!r} (free, total, matmul_error)")
        try:
            state[key] = float(value) if key == "matmul_error" else float(parse_size(value))
        except ValueError:
            raise ValueError(f"{FAKE_STATE_VARIABLE}: {item!r} is not {key}=NUMBER") from None
    return state


def gpu_health(gpu_id: str, index: int, simulated: bool,
               environ: Mapping[str, str]) -> dict[str, Any]:
    """This rank's GPU ``gpu_id`` (device ``index``): processes, memory, the matmul's error."""
    processes = gpu_processes(gpu_id)  # before this process holds a context on the GPU
    if simulated:
        state = fake_state(environ)
        total = state.get("total", 80.0 * 2 ** 30)
        free, total = state.get("free", total), total
        error = state.get("matmul_error", matmul_error(torch.device("cpu")))
    else:
        free, total = torch.cuda.mem_get_info(index)
        error = matmul_error(torch.device("cuda", index))
    return {"processes": processes, "free_bytes": int(free), "total_bytes": int(total),
            "matmul_error": error}
