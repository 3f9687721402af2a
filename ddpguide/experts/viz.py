"""Tokens per expert: how the chapter's router spreads a batch, balanced and with a hot expert,
and how the program's balance run moves it (the busiest expert's load, the z-loss)."""

from __future__ import annotations

import torch

from ddpguide.experts.traffic import PROGRAM
from ddpguide.launch import programs


def tokens_per_expert(skew: float, tokens: int = 256, experts: int = 8, k: int = 1,
                      capacity_factor: float = 1.25, hidden: int = 16, seed: int = 0,
                      program: str = PROGRAM) -> dict:
    """Route one group of random tokens with the program's layer and router.

    ``skew`` is added to expert 0's router bias (the program's ``--skew``).
    Returns the capacity and, per expert, the choices kept and dropped.
    """
    source = programs.load(program)
    layer = source.make_layer(hidden, 2 * hidden, experts, seed, skew)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1),
                    dtype=torch.float64)
    capacity = source.capacity_of(tokens, experts, k, capacity_factor)
    with torch.no_grad():
        probs = torch.softmax(layer.router(layer.norm(x)), dim=-1)
        _, expert, keep = source.route(probs, k, capacity)
        chosen = torch.bincount(expert.reshape(-1), minlength=experts)
        kept = torch.bincount(expert[keep], minlength=experts)
        prob_sum, counted = source.aux_loss_terms(probs, expert, experts)
        aux = experts * (counted / (k * tokens) * prob_sum / tokens).sum().item()
    return {"skew": skew, "capacity": capacity, "kept": kept.tolist(),
            "dropped": (chosen - kept).tolist(), "aux": aux, "tokens": tokens, "k": k}


def plot(cases: list[dict]):
    """One panel per case: kept and dropped choices per expert, and the capacity."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4.5 * len(cases), 3.2), sharey=True)
    axes = [axes] if len(cases) == 1 else list(axes)
    for ax, case in zip(axes, cases):
        experts = range(len(case["kept"]))
        ax.bar(experts, case["kept"], color="tab:blue", label="kept")
        ax.bar(experts, case["dropped"], bottom=case["kept"], color="tab:red", label="dropped")
        ax.axhline(case["capacity"], color="black", ls="--", lw=1, label="capacity")
        ax.set_xticks(list(experts))
        ax.set_xlabel("expert")
        ax.set_title(f"router bias of expert 0 + {case['skew']:g}: aux loss {case['aux']:.2f}",
                     fontsize=9)
    axes[0].set_ylabel(f"choices of {cases[0]['tokens']} tokens (k={cases[0]['k']})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


#: How each way of the program's balance run is named in the figure.
WAYS = {"none": "no balancing", "aux": "auxiliary loss", "z": "z-loss", "bias": "bias (no loss)"}


def plot_balance(balance: dict, within: float | None = None):
    """The program's balance run (its report's ``balance``): per step, the busiest expert's
    load over the mean (left) and the router z-loss (right), one line per way."""
    import matplotlib.pyplot as plt

    fig, (load, z) = plt.subplots(1, 2, figsize=(10, 3.2))
    for way, run in balance.items():
        steps = range(1, len(run["busiest"]) + 1)
        load.plot(steps, run["busiest"], label=WAYS.get(way, way), lw=1.2)
        z.plot(steps, run["z_loss"], label=WAYS.get(way, way), lw=1.2)
    if within is not None:
        load.axhline(within, color="black", ls="--", lw=1)
    load.set_ylabel("busiest expert's load / mean")
    z.set_ylabel("router z-loss")
    for ax in (load, z):
        ax.set_xlabel("SGD step")
    load.legend(fontsize=8)
    fig.tight_layout()
    return fig
