"""Published GPU runs the planner is compared with (GPU, model only: nothing here ran them).

* torchtitan's Llama 3.1 benchmarks on H100 (``TORCHTITAN``): each row its table, model,
  GPUs, layout, local batch, sequence, precision, activation checkpointing, and the
  reported tokens/s a GPU and memory (GiB). Rows with torch.compile or float8 count their
  element-wise work fused; rows with AsyncTP are predicted like the others, TP's
  collectives exposed.
* the Ultra-Scale Playbook's best configurations (``PLAYBOOK``): for each model size and
  number of 8-GPU nodes, the layout (DP, TP, PP, gradient accumulation, micro-batch, ZeRO
  stage) that reached the highest MFU among the thousands of runs it made with nanotron,
  sequence 4,096, global batch 1M tokens. The figures are the text of the playbook's
  heatmap (``assets/images/what_we_learnt_heatmap.svg``, whose labels are glyphs: read
  back from their character codes). The model shapes are nanotron's benchmark script's. They
  are predicted on ``H100-playbook``: the data sheet, with the bus bandwidths of all-reduce,
  all-gather and reduce-scatter that the Playbook measured on its cluster over 1 to 64 nodes.
* picotron's two MFU figures (``PICOTRON``), from its README, which gives no layout: each
  is set against the planner's best layout for the README's global batch.

Each source's MFU is predicted with that source's own FLOPs a token (picotron's count the
embedding too) and the 989.5 TFLOP/s H100 peak picotron divides by (the Playbook names no
peak: the same is taken), so a ratio of MFUs is a ratio of tokens/s.
"""

from __future__ import annotations

import dataclasses
import statistics
from types import ModuleType
from typing import Any

from ddpguide.plan import hardware, search

SOURCES = {
    "torchtitan": ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
                   "benchmarks/llama3_h100_202412_torchtitan.md"),
    "playbook": ("https://huggingface.co/spaces/nanotron/ultrascale-playbook, section 'Finding the Best "
                 "Training Configuration', its heatmap; read from the mirror "
                 "https://github.com/vinjn/nanotron-ultrascale-playbook/blob/"
                 "924e4d0b88e065a9a5198d75b113da1cf3bd4473/assets/images/what_we_learnt_heatmap.svg"),
    "playbook models": ("https://github.com/huggingface/nanotron/blob/0e0a27ea83cfe1ba61332a00383bb8307dd9e13d/"
                        "scripts/scaling_benchmarks.py (model_configs: layers, width, heads, MLP width; "
                        "vocabulary 131,072; key-value heads = heads; tied below an MLP of 10,000); the "
                        "MFU's FLOPs: get_flops in src/nanotron/models/llama.py @ "
                        "03b83fc825418ac4f22d2fcea41514cdba6cedb9"),
    "picotron": ("https://github.com/huggingface/picotron/blob/59714b1bf25541dbeb6f5a721ed15f6d0768e786/"
                 "README.md (the MFU figures, the create_config.py commands); picotron/utils.py get_mfu "
                 "(6 x parameters + 12 x layers x width x sequence a token, 989.5 TFLOP/s)"),
}
PEAK_MFU = 989.5e12  # the H100 peak picotron divides by (get_mfu); the Playbook's is taken the same

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

#: what a torchtitan row runs that the model does not represent (named in its technique)
UNMODELLED = {"AsyncTP": "AsyncTP overlaps TP's collectives with its matmuls; predicted with them exposed",
              "Interleaved": "two chunks a rank; predicted as 1F1B with the bubble halved, not simulated"}

#: (nodes of 8 H100, model, DP, TP, PP, gradient accumulation, micro-batch, ZeRO stage, MFU %, memory GB)
PLAYBOOK = (
    (64, "playbook-1b", 128, 2, 2, 1, 2, 1, 5.25, 8.40), (64, "playbook-3b", 128, 4, 1, 1, 2, 1, 10.49, 16.42),
    (64, "playbook-8b", 128, 4, 1, 1, 2, 0, 18.69, 57.76), (64, "playbook-80b", 32, 16, 1, 4, 2, 1, 17.79, 53.46),
    (32, "playbook-1b", 64, 4, 1, 1, 4, 0, 23.20, 19.57), (32, "playbook-3b", 64, 4, 1, 1, 4, 0, 26.77, 38.98),
    (32, "playbook-8b", 32, 8, 1, 1, 8, 0, 32.71, 63.39), (32, "playbook-80b", 4, 4, 16, 64, 1, 1, 30.75, 64.21),
    (16, "playbook-1b", 64, 2, 1, 1, 4, 0, 29.46, 38.84), (16, "playbook-3b", 32, 4, 1, 1, 8, 0, 34.59, 66.20),
    (16, "playbook-8b", 16, 8, 1, 2, 8, 0, 36.33, 66.88), (16, "playbook-80b", 1, 4, 32, 256, 1, 0, 34.29, 61.18),
    (8, "playbook-1b", 32, 1, 2, 8, 1, 1, 32.47, 16.27), (8, "playbook-3b", 32, 1, 2, 8, 1, 1, 35.53, 36.73),
    (8, "playbook-8b", 32, 1, 2, 8, 1, 1, 39.50, 59.09), (8, "playbook-80b", 1, 4, 16, 256, 1, 0, 30.65, 63.07),
    (4, "playbook-1b", 16, 1, 2, 16, 1, 1, 38.38, 16.39), (4, "playbook-3b", 16, 1, 2, 8, 2, 1, 40.39, 53.33),
    (4, "playbook-8b", 16, 1, 2, 16, 1, 1, 43.31, 61.10), (4, "playbook-80b", 1, 8, 4, 256, 1, 0, 14.76, 65.97),
    (2, "playbook-1b", 8, 1, 2, 32, 1, 1, 41.59, 19.45), (2, "playbook-3b", 8, 1, 2, 16, 2, 1, 43.77, 54.31),
    (2, "playbook-8b", 4, 4, 1, 16, 4, 1, 43.94, 58.34),
    (1, "playbook-1b", 4, 1, 2, 16, 4, 1, 44.32, 41.76), (1, "playbook-3b", 4, 1, 2, 32, 2, 1, 46.68, 56.87),
    (1, "playbook-8b", 2, 1, 4, 128, 1, 1, 45.22, 63.07),
)
PLAYBOOK_SEQ = 4096

#: (model, GPUs, MFU %, micro-batch, sequence, gradient accumulation): picotron's README
PICOTRON = (("smollm-1.7b", 8, 50.0, 4, 1024, 32), ("llama2-7b", 64, 38.0, 4, 1024, 32))


def flops_per_token(m: Any, seq: int, embedding: bool = False) -> float:
    """The FLOPs a token that nanotron's MFU counts (get_flops): 6 x the matmul weights (the
    head included) + 12 x layers x width x sequence (attention, no causal half). picotron's
    (get_mfu) count 6 x every parameter: with ``embedding``, the embedding too, apart from
    the output projection as picotron's model keeps it (norms left out: under 0.01%)."""
    per_layer = 2 * m.dim * m.dim + 2 * m.dim * m.kv_dim + m.ffn * m.dim * (3 if m.gated else 2)
    return 6 * (m.layers * per_layer + (1 + embedding) * m.vocab * m.dim) + 12 * m.layers * m.dim * seq


def _torchtitan(p: ModuleType, catalog: ModuleType) -> list[dict]:
    hw = hardware.named(p, "H100-titan")
    rows = []
    for table, technique, name, gpus, axes, local, seq, dtype, ac, schedule, tps, gib in TORCHTITAN:
        dp = axes.get("dp_shard", 1) * axes.get("dp_replicate", 1)
        microbatches = local if axes.get("pp", 1) > 1 else 1  # torchtitan: micro-batches of 1
        layout = p.Layout(**axes, microbatches=microbatches, schedule=schedule, ac=ac,
                          loss_parallel=axes.get("tp", 1) > 1)
        assert layout.world == gpus, (technique, layout.world, gpus)
        policy = dataclasses.replace(catalog.policy(p, dtype), fused="compile" in technique or dtype == "float8")
        out = p.predict(catalog.model(p, name), layout, policy, hw, local * dp, seq)
        rows.append({"source": "torchtitan", "key": f"torchtitan table {table}, {name}, {technique}",
                     "model": name, "gpus": gpus, "technique": technique, "seq": seq, "unit": "tokens/s a GPU",
                     "reported": tps, "predicted": out["tokens_per_gpu"], "ratio": out["tokens_per_gpu"] / tps,
                     "reported_gib": gib, "predicted_gib": out["peak_memory"] / 2**30,
                     "memory_ratio": out["peak_memory"] / 2**30 / gib, "step": out["step"],
                     "unmodelled": UNMODELLED.get(next((k for k in UNMODELLED if k in technique), ""), "")})
    return rows


def playbook_layout(p: ModuleType, dp: int, tp: int, pp: int, gas: int, zero: int) -> Any:
    """nanotron's layout in the program's terms: DP replicas (ZeRO-1 splits AdamW's state),
    TP with sequence parallelism and a vocabulary-parallel loss, 1F1B over gas micro-batches,
    run by nanotron's own engine (none of the tensors only torch's pipelining, FSDP2 and
    loss_parallel hold)."""
    return p.Layout(pp=pp, dp_replicate=dp, tp=tp, microbatches=gas if pp > 1 else 1,
                    accumulate=1 if pp > 1 else gas, zero=zero, loss_parallel=tp > 1, engine="nanotron")


def _policy(p: ModuleType) -> Any:
    return p.Policy(param=4, compute=2, reduce=4, state=4)


def _mfu(p: ModuleType, model: Any, layout: Any, hw: Any, batch: int, seq: int,
         embedding: bool = False) -> tuple[float, dict]:
    out = p.predict(model, layout, _policy(p), hw, batch, seq)
    return out["tokens_per_gpu"] * flops_per_token(model, seq, embedding) / PEAK_MFU * 100, out


def _fits(p: ModuleType, model: Any, layout: Any, hw: Any, batch: int, seq: int) -> bool:
    """Whether the layout's busiest rank fits (the memory half of ``predict`` alone), to skip
    the step's prediction of a layout that cannot be chosen."""
    return search.margin(p.peak_memory(model, layout, _policy(p), batch, seq), hw) >= 0


def playbook(p: ModuleType, catalog: ModuleType, sheet: str = "H100-playbook") -> list[dict]:
    """The Playbook's rows, predicted on ``sheet`` (its cluster as it measured it, or a data sheet)."""
    hw = hardware.named(p, sheet)
    rows = []
    for nodes, name, dp, tp, pp, gas, mbs, zero, mfu, gb in PLAYBOOK:
        layout = playbook_layout(p, dp, tp, pp, gas, zero)
        assert layout.world == 8 * nodes, (nodes, name)
        predicted, out = _mfu(p, catalog.model(p, name), layout, hw, dp * gas * mbs, PLAYBOOK_SEQ)
        rows.append({"source": "playbook", "key": f"playbook, {name}, {nodes} nodes", "model": name,
                     "gpus": 8 * nodes, "technique": f"DP {dp} TP {tp} PP {pp} GAS {gas} MBS {mbs} ZeRO-{zero}",
                     "seq": PLAYBOOK_SEQ, "unit": "MFU %", "reported": mfu, "predicted": predicted,
                     "ratio": predicted / mfu, "reported_gib": gb * 1e9 / 2**30,
                     "predicted_gib": out["peak_memory"] / 2**30, "step": out["step"]})
    return rows


def best(p: ModuleType, catalog: ModuleType, name: str, gpus: int, batch: int, seq: int, hw_name: str = "H100",
         embedding: bool = False, zeros: tuple[int, ...] = (0, 1)) -> dict[str, Any] | None:
    """The planner's best layout that fits, among the ones nanotron and picotron run (DP, TP,
    PP, gradient accumulation; ZeRO stages ``zeros`` where there are replicas), for a global
    batch of `batch` sequences (MFU counted as flops_per_token does with ``embedding``)."""
    model, hw = catalog.model(p, name), hardware.named(p, hw_name)
    found = None
    for axes in search.sizes(p, model, gpus, seq, ("pp", "dp_replicate", "tp")):
        pp, dp, tp = axes["pp"], axes["dp_replicate"], axes["tp"]
        if tp not in (1, 2, 4, 8) or batch % dp:  # TP inside a node of 8
            continue
        for gas in (g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256) if (batch // dp) % g == 0):
            if pp > 1 and gas < pp:
                continue
            for zero in zeros if dp > 1 else (0,):
                layout = playbook_layout(p, dp, tp, pp, gas, zero)
                if not _fits(p, model, layout, hw, batch, seq):
                    continue
                mfu, out = _mfu(p, model, layout, hw, batch, seq, embedding)
                if found is None or mfu > found[0]:
                    found = (mfu, layout, out)
    if found is None:
        return None
    mfu, layout, out = found
    mbs = batch // layout.data_parallel // (layout.microbatches if layout.pp > 1 else layout.accumulate)
    return {"mfu": mfu, "layout": layout, "name": search.name(layout),
            "technique": f"DP {layout.dp_replicate} TP {layout.tp} PP {layout.pp} GAS "
                         f"{layout.microbatches if layout.pp > 1 else layout.accumulate} MBS {mbs} "
                         f"ZeRO-{layout.zero}"}


def _picotron(p: ModuleType, catalog: ModuleType) -> list[dict]:
    rows = []
    for name, gpus, mfu, mbs, seq, gas in PICOTRON:
        chosen = best(p, catalog, name, gpus, gpus * mbs * gas, seq, embedding=True, zeros=(0,))
        if chosen is None:
            raise LookupError(f"picotron, {name} on {gpus} GPUs: no layout fits")
        predicted = chosen["mfu"]
        rows.append({"source": "picotron", "key": f"picotron, {name}, {gpus} GPUs", "model": name, "gpus": gpus,
                     "apart": True,
                     "technique": f"layout not published; the planner's best: {chosen['technique']}", "seq": seq,
                     "unit": "MFU %", "reported": mfu, "predicted": predicted, "ratio": predicted / mfu})
    return rows


def compare(p: ModuleType) -> list[dict]:
    """Every published row beside the planner's prediction of it (tokens/s a GPU or MFU)."""
    from ddpguide.plan import catalog

    return _torchtitan(p, catalog) + playbook(p, catalog) + _picotron(p, catalog)


def choices(p: ModuleType) -> list[dict]:
    """For each of the Playbook's best configurations, the planner's own best beside it, and
    the MFU the planner predicts for the Playbook's own layout."""
    from ddpguide.plan import catalog

    out = []
    hw = hardware.named(p, "H100-playbook")
    for nodes, name, dp, tp, pp, gas, mbs, zero, mfu, _ in PLAYBOOK:
        chosen = best(p, catalog, name, 8 * nodes, dp * gas * mbs, PLAYBOOK_SEQ, "H100-playbook")
        predicted, theirs = _mfu(p, catalog.model(p, name), playbook_layout(p, dp, tp, pp, gas, zero), hw,
                                 dp * gas * mbs, PLAYBOOK_SEQ)
        out.append({"model": name, "nodes": nodes,
                    "theirs": f"DP {dp} TP {tp} PP {pp} GAS {gas} MBS {mbs} ZeRO-{zero}", "their_mfu": mfu,
                    "their_predicted_mfu": predicted, "their_predicted_gib": theirs["peak_memory"] / 2**30,
                    "their_fits": search.margin(theirs["peak_memory"], hw) >= 0,
                    "planner": chosen["technique"] if chosen else "none fits",
                    "planner_mfu": chosen["mfu"] if chosen else float("nan")})
    return out


def headroom(p: ModuleType) -> float:
    """What the GPU holds over the predicted peak: the median, over torchtitan's rows, of its
    reported memory (torchtitan logs the caching allocator's ``max_reserved``:
    ``DeviceMemoryMonitor.get_peak_stats`` in torchtitan/tools/utils.py) over the planner's
    predicted peak. It holds what the prediction leaves out, the allocator's reserve and
    fragmentation, NCCL's buffers and workspaces, in one figure."""
    from ddpguide.plan import catalog

    return statistics.median(r["reported_gib"] / r["predicted_gib"] for r in _torchtitan(p, catalog))


def _spread(ratios: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "count": len(ratios),
            "within": sum(0.8 <= r <= 1.25 for r in ratios)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios by source (median, range, rows within 0.8-1.25), and pooled over the rows that
    predict a published run: the rows set against the planner's own best layout (picotron's,
    which publish no layout) are shown apart and left out of the pooled figures. ``model_version``:
    the cost model's source hash these ratios belong to."""
    compared = [r["ratio"] for r in rows if not r.get("apart")]
    sources = {s: _spread([r["ratio"] for r in rows if r["source"] == s]) for s in dict.fromkeys(
        r["source"] for r in rows)}
    return {**_spread(compared), "outside_half_to_two": sum(not 0.5 <= r <= 2 for r in compared),
            "apart": [r["key"] for r in rows if r.get("apart")], "sources": sources,
            **{f"median_{s}": v["median"] for s, v in sources.items()}, "model_version": search.version()}
