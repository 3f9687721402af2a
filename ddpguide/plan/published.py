"""Published GPU runs the planner is compared with (GPU, model only: nothing here ran them).

torchtitan's Llama 3.1 benchmarks on H100 (``pytorch/torchtitan``,
``benchmarks/llama3_h100_202412_torchtitan.md`` at commit
``31a17bfdb70bab6f62a13d21816a5339b911d6e3``): each row its table, model, GPUs, layout, local
batch, sequence, precision, activation checkpointing, and the reported tokens/s a GPU and
memory (GiB). Rows with torch.compile or AsyncTP are predicted like eager ones: the cost
model counts element-wise traffic unfused and TP's collectives exposed.
"""

from __future__ import annotations

import statistics
from types import ModuleType

SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
          "@ 31a17bfdb70bab6f62a13d21816a5339b911d6e3")

# (table, technique, model, gpus, {axes}, local batch, seq, dtype, ac, schedule, tokens/s a GPU, GiB)
TORCHTITAN = (
    (1, "FSDP", "llama3-8b", 8, {"dp_shard": 8}, 2, 8192, "bf16", "selective", "1F1B", 5762, 82.4),
    (1, "FSDP + compile", "llama3-8b", 8, {"dp_shard": 8}, 2, 8192, "bf16", "selective", "1F1B", 6667, 77.0),
    (1, "FSDP + compile + float8", "llama3-8b", 8, {"dp_shard": 8}, 2, 8192, "float8", "selective", "1F1B",
     8532, 76.8),
    (2, "FSDP 8, CP 1", "llama3-8b", 8, {"dp_shard": 8}, 1, 32768, "float8", "full", "1F1B", 3890, 83.9),
    (2, "FSDP 4, CP 2", "llama3-8b", 8, {"dp_shard": 4, "cp": 2}, 1, 65536, "float8", "full", "1F1B", 2540, 84.2),
    (2, "FSDP 2, CP 4", "llama3-8b", 8, {"dp_shard": 2, "cp": 4}, 1, 131072, "float8", "full", "1F1B", 1071, 84.0),
    (2, "FSDP 1, CP 8", "llama3-8b", 8, {"cp": 8}, 1, 262144, "float8", "full", "1F1B", 548, 84.5),
    (3, "FSDP", "llama3-8b", 128, {"dp_shard": 128}, 2, 8192, "bf16", "selective", "1F1B", 5605, 67.0),
    (3, "FSDP + compile", "llama3-8b", 128, {"dp_shard": 128}, 2, 8192, "bf16", "selective", "1F1B", 6514, 62.0),
    (3, "FSDP + compile + float8", "llama3-8b", 128, {"dp_shard": 128}, 2, 8192, "float8", "selective", "1F1B",
     8380, 61.8),
    (4, "2D", "llama3-70b", 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "float8", "full", "1F1B", 829, 71.9),
    (4, "2D + AsyncTP", "llama3-70b", 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "float8", "full", "1F1B", 876, 67.6),
    (5, "3D, 1F1B", "llama3-405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 32, 8192, "float8", "full", "1F1B",
     100, 82.5),
    (5, "3D, Interleaved 1F1B", "llama3-405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 32, 8192, "float8",
     "full", "Interleaved1F1B", 128, 72.7),
    (6, "FSDP 8, CP 1", "llama3-405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 8, 32768, "float8", "full",
     "1F1B", 76, 75.3),
    (6, "FSDP 4, CP 2", "llama3-405b", 512, {"dp_shard": 4, "cp": 2, "tp": 8, "pp": 8}, 8, 65536, "float8",
     "full", "1F1B", 47, 75.9),
    (6, "FSDP 2, CP 4", "llama3-405b", 512, {"dp_shard": 2, "cp": 4, "tp": 8, "pp": 8}, 8, 131072, "float8",
     "full", "1F1B", 31, 77.1),
    (6, "FSDP 1, CP 8", "llama3-405b", 512, {"cp": 8, "tp": 8, "pp": 8}, 8, 262144, "float8", "full", "1F1B",
     16, 84.9),
)


def compare(p: ModuleType, hardware: str = "H100-titan") -> list[dict]:
    """Each published row beside the planner's prediction of it (tokens/s a GPU, memory)."""
    from ddpguide.plan import catalog

    hw = catalog.hardware(p, hardware)
    rows = []
    for table, technique, name, gpus, axes, local, seq, dtype, ac, schedule, tps, gib in TORCHTITAN:
        dp = axes.get("dp_shard", 1) * axes.get("dp_replicate", 1)
        microbatches = local if axes.get("pp", 1) > 1 else 1  # torchtitan: micro-batches of 1
        layout = p.Layout(**axes, microbatches=microbatches, schedule=schedule, ac=ac,
                          loss_parallel=axes.get("tp", 1) > 1)
        assert layout.world == gpus, (technique, layout.world, gpus)
        out = p.predict(catalog.model(p, name), layout, catalog.policy(p, dtype), hw, local * dp, seq)
        rows.append({"source": f"torchtitan table {table}", "model": name, "gpus": gpus,
                     "technique": technique, "seq": seq, "reported_tokens_per_gpu": tps,
                     "predicted_tokens_per_gpu": out["tokens_per_gpu"],
                     "ratio": out["tokens_per_gpu"] / tps, "reported_gib": gib,
                     "predicted_gib": out["peak_memory"] / 2**30,
                     "memory_ratio": out["peak_memory"] / 2**30 / gib})
    return rows


def summary(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "outside_half_to_two": sum(not 0.5 <= r <= 2 for r in ratios)}
