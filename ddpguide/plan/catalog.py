"""Named models, hardware data sheets and dtype policies the planner knows, each with its source.

The figures are the program's own types (``book/programs/plan_cost.py``: ``Model``,
``Hardware``, ``Policy``), built from the tables here; nothing in them comes from a run of
a layout the planner predicts.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

#: name -> (the model's shape, its source)
MODELS: dict[str, tuple[dict, str]] = {
    "gpt": (dict(layers=4, dim=64, heads=4, ffn=256, vocab=256, tied=True, cp_mask=True),
            "book/programs/gpt/model.py (Config defaults; ffn 4 x dim)"),
    "gpt-check": (dict(layers=2, dim=32, heads=4, ffn=128, vocab=256, tied=True, cp_mask=True),
                  "the chapter-14 checks' model (ddpguide.gpt.layouts.CHECK)"),
    "llama3-8b": (dict(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                       gated=True, tied=False, mask=False),
                  "Llama 3 herd of models, arXiv 2407.21783, table 3; torchtitan llama3 args"),
    "llama3-70b": (dict(layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                        gated=True, tied=False, mask=False), "arXiv 2407.21783, table 3"),
    "llama3-405b": (dict(layers=126, dim=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256,
                         gated=True, tied=False, mask=False), "arXiv 2407.21783, table 3"),
    # the Ultra-Scale Playbook's benchmark models (nanotron scripts/scaling_benchmarks.py)
    "playbook-1b": (dict(layers=16, dim=2048, heads=32, ffn=8192, vocab=131072, gated=True, tied=True, mask=False),
                    "nanotron scripts/scaling_benchmarks.py '1B' (1.34B with 32 key-value heads)"),
    "playbook-3b": (dict(layers=28, dim=3072, heads=32, ffn=8192, vocab=131072, gated=True, tied=True, mask=False),
                    "nanotron scripts/scaling_benchmarks.py '3B' (3.57B)"),
    "playbook-8b": (dict(layers=32, dim=4096, heads=32, ffn=14336, vocab=131072, gated=True, tied=False,
                         mask=False), "nanotron scripts/scaling_benchmarks.py '8B' (8.86B)"),
    "playbook-80b": (dict(layers=80, dim=8192, heads=64, ffn=28672, vocab=131072, gated=True, tied=False,
                          mask=False), "nanotron scripts/scaling_benchmarks.py '70B' (80.0B)"),
    "smollm-1.7b": (dict(layers=24, dim=2048, heads=32, ffn=8192, vocab=49152, gated=True, tied=True, mask=False),
                    "HuggingFaceTB/SmolLM-1.7B config (1.71B parameters)"),
    "llama2-7b": (dict(layers=32, dim=4096, heads=32, ffn=11008, vocab=32000, gated=True, tied=False, mask=False),
                  "Llama 2, arXiv 2307.09288 (6.74B parameters)"),
    "deepseek-moe-16b": (dict(layers=28, dim=2048, heads=16, ffn=1408, vocab=102400, experts=64,
                              top_k=6, shared=2, gated=True, tied=False, mask=False),
                         "DeepSeekMoE, arXiv 2401.06066, section 5 (its first dense layer "
                         "counted as an MoE layer here)"),
}

_NVIDIA = "NVIDIA data sheet"
_FA = ("FlashAttention-3, arXiv 2407.08608, figure 5: FlashAttention-2 on H100 SXM5, bf16, "
       "head dim 128, about 350 TFLOPS forward")
_FA_BWD = ("FlashAttention-3, arXiv 2407.08608, figure 'Attention backward speed, head dim 128 (H100 80GB "
           "SXM5)': FlashAttention-2 318 TFLOPS at 8k, 322 at 16k (FLOPs counted as 2.5 x the forward's)")
_MAMF = ("stas00/ml-engineering compute/accelerator/README.md @ 744d01e18b79512572f64a6bbd8b5f4a725203a7, "
         "'Maximum Achievable Matmul FLOPS comparison table'")
#: name -> the hardware's figures (plan_cost.Hardware fields) and their sources
HARDWARE: dict[str, dict] = {
    "H100": dict(name="H100", peak=989e12, peak_float8=1979e12, memory=80e9, bandwidth=3.35e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 450e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.803, ceiling_float8=0.709, overlap=True,
                 attention=350e12, attention_backward=320e12,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, H100 SXM (dense bf16, fp8)",
                          "attention": _FA, "attention backward": _FA_BWD,
                          "node link": "NVLink 4: 900 GB/s both ways, 450 each",
                          "net link": "400 Gb/s a GPU (ConnectX-7)",
                          "ceiling": f"{_MAMF}: H100 SXM, bf16 794.5 of 989 TFLOPS, float8 1402.6 of 1979",
                          "alpha, per-call": "assumed: NCCL's few-microsecond latencies"}),
    "H200": dict(name="H200", peak=989e12, peak_float8=1979e12, memory=141e9, bandwidth=4.8e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 450e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.803, ceiling_float8=0.734, overlap=True,
                 attention=350e12, attention_backward=320e12,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, H200 SXM", "attention": _FA,
                          "attention backward": _FA_BWD,
                          "node link": "NVLink 4, 450 GB/s each way", "net link": "400 Gb/s a GPU",
                          "ceiling": f"{_MAMF}: bf16 H100 SXM's ('H200 is the same'), float8 H200 SXM 1453.4 "
                                     "of 1979",
                          "alpha, per-call": "assumed"}),
    "A100": dict(name="A100", peak=312e12, memory=80e9, bandwidth=2.039e12, gpus_per_node=8,
                 links={"node": [3e-6, 1 / 300e9], "net": [10e-6, 1 / 25e9]},
                 collective_seconds=10e-6, ceiling=0.869, overlap=True,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, A100 SXM 80GB",
                          "node link": "NVLink 3: 600 GB/s both ways", "net link": "200 Gb/s a GPU (HDR)",
                          "ceiling": f"{_MAMF}: A100 SXM 271.2 of 312", "alpha, per-call": "assumed"}),
    "B200": dict(name="B200", peak=2.25e15, peak_float8=4.5e15, memory=180e9, bandwidth=7.7e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 900e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.776, ceiling_float8=0.763, overlap=True,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, HGX B200 (dense)",
                          "node link": "NVLink 5: 1.8 TB/s both ways", "net link": "400 Gb/s a GPU",
                          "ceiling": f"{_MAMF}: B200 SXM, bf16 1745.0 of 2250, float8 3432.5 of 4500",
                          "alpha, per-call": "assumed"}),
}
# torchtitan's benchmark machines (benchmarks/llama3_h100_202412_torchtitan.md): H100 with
# 96 GB HBM2e at 2.4 TB/s, 500 W; "the actual peak TFLOPs number is between SXM and NVL":
# the midpoint of 989 (SXM) and 835 (NVL) dense bf16 is taken here, and the attention kernel's
# rates, measured on an SXM, are scaled by the same ratio (the clock)
_TITAN = 912 / 989
HARDWARE["H100-titan"] = {**HARDWARE["H100"], "name": "H100-titan", "memory": 96e9, "bandwidth": 2.4e12,
                          "peak": 912e12, "peak_float8": 1824e12, "attention": 350e12 * _TITAN,
                          "attention_backward": 320e12 * _TITAN,
                          "sources": {**HARDWARE["H100"]["sources"],
                                      "peak, memory, bandwidth": "torchtitan benchmarks/"
                                      "llama3_h100_202412_torchtitan.md (peak: SXM/NVL midpoint)",
                                      "attention": f"{_FA}; times 912/989", "attention backward":
                                      f"{_FA_BWD}; times 912/989"}}
# the Playbook's cluster: H100 nodes (it names no variant: the SXM data sheet) whose collectives
# it measured (256 MB, the median of its runs) over 1 to 64 whole nodes of 8 GPUs: bus bandwidth
# in GB/s by the nodes spanned
_PLAYBOOK_NODES = (1, 2, 4, 8, 16, 32, 64)
_PLAYBOOK_BUS = {"all_reduce": (436.0, 361.7, 160.1, 99.6, 84.7, 64.9, 32.9),
                 "all_gather": (249.8, 184.6, 119.0, 69.0, 55.0, 28.0, 11.0),
                 "reduce_scatter": (249.7, 181.6, 115.8, 68.6, 54.5, 27.9, 11.1)}
HARDWARE["H100-playbook"] = {
    **HARDWARE["H100"], "name": "H100-playbook",
    "bus": {kind: [[n, gb * 1e9] for n, gb in zip(_PLAYBOOK_NODES, row)] for kind, row in _PLAYBOOK_BUS.items()},
    "sources": {**HARDWARE["H100"]["sources"],
                "bus": ("the Ultra-Scale Playbook, section 'Pipeline Parallelism', figure 'Communication "
                        "Bandwidth by Number of Nodes (size=256MB)' (median); its data: "
                        "https://github.com/vinjn/nanotron-ultrascale-playbook/blob/"
                        "e3bcfc5c0b177d5f259a65465ddf0f880c71577f/assets/data/benchmarks/pp_comm_bandwidth.html"),
                "net link": "the H100's, for what the Playbook did not measure (send, all-to-all)"}}

#: name -> bytes per element (plan_cost.Policy fields)
POLICIES: dict[str, dict] = {
    "float32": dict(param=4, compute=4, reduce=4, state=4),
    "float64": dict(param=8, compute=8, reduce=8, state=8),
    # torchtitan's: fp32 weights and AdamW state, bf16 gathered weights and activations, fp32 reduce
    "bf16": dict(param=4, compute=2, reduce=4, state=4),
    "float8": dict(param=4, compute=2, reduce=4, state=4, float8=True),
}


def model(program: ModuleType, name: str, **changes: Any) -> Any:
    """The named model as a ``plan_cost.Model``, ``changes`` applied to its shape."""
    shape, _ = MODELS[name]
    return program.Model(**{**shape, **changes})


def policy(program: ModuleType, name: str) -> Any:
    """The named dtype policy as a ``plan_cost.Policy`` (the hardware: :mod:`ddpguide.plan.hardware`)."""
    return program.Policy(**POLICIES[name])
