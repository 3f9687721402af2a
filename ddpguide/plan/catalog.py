"""Named models, hardware data sheets and dtype policies the planner knows, each with its source.

The figures are the program's own types (``book/programs/plan_cost.py``: ``Model``,
``Hardware``, ``Policy``), built from the tables here; nothing in them comes from a run of
a layout the planner predicts.
"""

from __future__ import annotations

from types import ModuleType

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
_MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (bf16)")
#: name -> the hardware's figures (plan_cost.Hardware fields) and their sources
HARDWARE: dict[str, dict] = {
    "H100": dict(name="H100", peak=989e12, peak_float8=1979e12, memory=80e9, bandwidth=3.35e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 450e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.801, overlap=True, attention=350e12,
                 attention_backward=320e12,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, H100 SXM (dense bf16, fp8)",
                          "attention": _FA, "attention backward": _FA_BWD,
                          "node link": "NVLink 4: 900 GB/s both ways, 450 each",
                          "net link": "400 Gb/s a GPU (ConnectX-7)",
                          "ceiling": f"{_MAMF}: H100 SXM 792.1 of 989 TFLOPS",
                          "alpha, per-call": "assumed: NCCL's few-microsecond latencies"}),
    "H200": dict(name="H200", peak=989e12, peak_float8=1979e12, memory=141e9, bandwidth=4.8e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 450e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.801, overlap=True, attention=350e12,
                 attention_backward=320e12,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, H200 SXM", "attention": _FA,
                          "attention backward": _FA_BWD,
                          "node link": "NVLink 4, 450 GB/s each way", "net link": "400 Gb/s a GPU",
                          "ceiling": "H100's (the same compute die)",
                          "alpha, per-call": "assumed"}),
    "A100": dict(name="A100", peak=312e12, memory=80e9, bandwidth=2.039e12, gpus_per_node=8,
                 links={"node": [3e-6, 1 / 300e9], "net": [10e-6, 1 / 25e9]},
                 collective_seconds=10e-6, ceiling=0.859, overlap=True,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, A100 SXM 80GB",
                          "node link": "NVLink 3: 600 GB/s both ways", "net link": "200 Gb/s a GPU (HDR)",
                          "ceiling": f"{_MAMF}: A100 SXM 267.9 of 312", "alpha, per-call": "assumed"}),
    "B200": dict(name="B200", peak=2.25e15, peak_float8=4.5e15, memory=180e9, bandwidth=7.7e12,
                 gpus_per_node=8, links={"node": [3e-6, 1 / 900e9], "net": [10e-6, 1 / 50e9]},
                 collective_seconds=10e-6, ceiling=0.801, overlap=True,
                 sources={"peak, memory, bandwidth": f"{_NVIDIA}, HGX B200 (dense)",
                          "node link": "NVLink 5: 1.8 TB/s both ways", "net link": "400 Gb/s a GPU",
                          "ceiling": "assumed H100's (no published MAMF here)", "alpha, per-call": "assumed"}),
}
# torchtitan's benchmark machines (benchmarks/llama3_h100_202412_torchtitan.md): H100 with
# 96 GB HBM2e at 2.4 TB/s, 500 W; "the actual peak TFLOPs number is between SXM and NVL":
# the midpoint of 989 (SXM) and 835 (NVL) dense bf16 is taken here
HARDWARE["H100-titan"] = {**HARDWARE["H100"], "name": "H100-titan", "memory": 96e9, "bandwidth": 2.4e12,
                          "peak": 912e12, "peak_float8": 1824e12,
                          "sources": {**HARDWARE["H100"]["sources"],
                                      "peak, memory, bandwidth": "torchtitan benchmarks/"
                                      "llama3_h100_202412_torchtitan.md (peak: SXM/NVL midpoint)"}}

#: name -> bytes per element (plan_cost.Policy fields)
POLICIES: dict[str, dict] = {
    "float32": dict(param=4, compute=4, reduce=4, state=4),
    "float64": dict(param=8, compute=8, reduce=8, state=8),
    # torchtitan's: fp32 weights and AdamW state, bf16 gathered weights and activations, fp32 reduce
    "bf16": dict(param=4, compute=2, reduce=4, state=4),
    "float8": dict(param=4, compute=2, reduce=4, state=4, float8=True),
}


def model(program: ModuleType, name: str, **changes):
    shape, _ = MODELS[name]
    return program.Model(**{**shape, **changes})


def hardware(program: ModuleType, name: str, **changes):
    return program.Hardware(**{**HARDWARE[name], **changes})


def policy(program: ModuleType, name: str):
    return program.Policy(**POLICIES[name])
