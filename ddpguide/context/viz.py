"""Figures of the context-parallelism chapter: memory per rank, work per rank."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt

MIB = 2 ** 20


def plot_memory(seqs: Sequence[int], peaks: dict[int, list[int]]):
    """Peak activation memory per rank against the sequence length, log-log."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for world, values in sorted(peaks.items()):
        label = "1 process, full attention" if world == 1 else f"ring attention, {world} ranks"
        ax.plot(seqs, [v / MIB for v in values], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak activation memory per rank (MiB)")
    ax.set_title("Attention forward + backward, float64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_work(work: dict[str, list[float]]):
    """Block products per rank under the causal mask, one group of bars per split."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(work)
    world = len(work[names[0]])
    width = 0.8 / len(names)
    for n, name in enumerate(names):
        ax.bar([r + n * width for r in range(world)], work[name], width, label=name)
    ax.axhline(sum(work[names[0]]) / world, color="grey", linestyle="--", label="mean")
    ax.set_xticks([r + width * (len(names) - 1) / 2 for r in range(world)])
    ax.set_xticklabels([f"rank {r}" for r in range(world)])
    ax.set_ylabel("block products (S/N x S/N)")
    ax.set_title(f"Causal attention on {world} ranks")
    ax.legend()
    fig.tight_layout()
    return fig
