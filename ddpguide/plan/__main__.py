"""``python -m ddpguide.plan``: every layout of a model on N GPUs, ranked by predicted step time.

    python -m ddpguide.plan --model llama3-8b --gpus 8 --hardware H100 --seq 8192 --global-batch 16
    python -m ddpguide.plan --model gpt --gpus 4 --gpus-per-node 2 --hardware this-machine --json
    python -m ddpguide.plan --model gpt --dim 256 --layers 2 --gpus 4 --gpus-per-node 2 \
        --hardware cluster --link 20mbit --runnable          (root: chapter 15's emulated cluster)

Every input is checked before anything runs or is written: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import ModuleType
from typing import Any

from ddpguide.core.commands import InputError, OneLineParser
from ddpguide.plan import catalog, hardware, published, render, search

SHAPE = ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "experts", "top_k")
PROG = "python -m ddpguide.plan"


def parser() -> argparse.ArgumentParser:
    """The command's options."""
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", help=f"one of {', '.join(catalog.MODELS)}")
    for name in SHAPE:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help="change the model's shape")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, help="(default: the hardware's)")
    p.add_argument("--hardware", default="H100",
                   help=f"{', '.join(catalog.HARDWARE)} (any case), this-machine (measured now), cluster (chapter 15's "
                   "emulated nodes, measured now), or a JSON file")
    p.add_argument("--link", help="with --hardware cluster: the rate of each node's link (default 20mbit)")
    p.add_argument("--dtype", default="", help=f"one of {', '.join(catalog.POLICIES)} "
                   "(default: float32 on this machine, bf16 on a GPU)")
    p.add_argument("--seq", type=int, default=0, help="tokens a sequence (default: 64, 8192 for Llama)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences a step, all GPUs")
    p.add_argument("--headroom", type=float, help="what the GPU holds over the predicted peak (default: "
                   "torchtitan's reserved over predicted on a data sheet's GPU, 1 on this machine's CPU)")
    p.add_argument("--runnable", action="store_true", help="only layouts the capstone's train.py runs")
    p.add_argument("--top", type=int, default=10, help="rows of the table (0: all)")
    p.add_argument("--json", action="store_true", help="every layout as JSON on stdout")
    return p


def check(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the options (None: all is well)."""
    if args.model not in catalog.MODELS:
        return f"--model {args.model}: not one of {', '.join(catalog.MODELS)}"
    for name in (*SHAPE, "gpus", "gpus_per_node", "seq", "global_batch", "top"):
        value = getattr(args, name)
        low = 0 if name in ("kv_heads", "experts", "top", "seq") else 1
        if value is not None and value < low:
            return f"--{name.replace('_', '-')} {value}: must be at least {low}"
    if args.headroom is not None and not 1 <= args.headroom <= 4:
        return f"--headroom {args.headroom}: between 1 and 4 (times the predicted peak)"
    if args.dtype and args.dtype not in catalog.POLICIES:
        return f"--dtype {args.dtype}: not one of {', '.join(catalog.POLICIES)}"
    sheet = None  # a data sheet or a file: known before anything runs
    if args.hardware not in hardware.MEASURED:
        try:
            sheet = hardware.load(search.program(), args.hardware)
        except InputError as error:
            return str(error)
    if args.hardware != "cluster":  # this machine's nodes: the program's default, as hardware.measured keeps it
        per_node = args.gpus_per_node or (sheet or search.program().Hardware()).gpus_per_node
        try:
            render.nodes(args.gpus, per_node)
        except render.Unrunnable:
            return (f"--gpus {args.gpus}: does not fill whole nodes of {per_node} GPUs "
                    f"(--gpus-per-node {per_node}); plan a multiple of {per_node}")
    if args.link is not None and args.hardware != "cluster":
        return f"--link {args.link}: only with --hardware cluster"
    if args.hardware == "cluster":
        from ddpguide.cluster.netns import missing_prerequisite
        from ddpguide.cluster.spec import MAX_NODES, parse_rate

        per_node = args.gpus_per_node or 2
        if args.gpus % per_node or not 2 <= args.gpus // per_node <= MAX_NODES:
            return (f"--gpus {args.gpus}: with --hardware cluster, 2 to {MAX_NODES} nodes of "
                    f"--gpus-per-node {per_node}")
        try:
            parse_rate(args.link or "20mbit", "--link")
        except InputError as error:
            return str(error)
        missing = missing_prerequisite()
        if missing:
            return f"--hardware cluster: {missing}"
    shape = {**catalog.MODELS[args.model][0],
             **{k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None}}
    if shape["dim"] % shape["heads"]:
        return f"--dim {shape['dim']}: does not split into {shape['heads']} heads"
    if shape.get("experts") and not 1 <= shape.get("top_k", 1) <= shape["experts"]:
        return f"--top-k {shape.get('top_k')}: between 1 and --experts {shape['experts']}"
    return None


def hardware_of(p: ModuleType, args: argparse.Namespace) -> Any:
    """The hardware's figures: a data sheet, a file, or measured now (this machine, or the cluster)."""
    if args.hardware == "cluster":
        from ddpguide.cluster import Spec, up
        from ddpguide.plan import measure

        per_node = args.gpus_per_node or 2
        with up(Spec(nodes=args.gpus // per_node, ranks_per_node=per_node, link=args.link or "20mbit")) as cluster:
            print(f"measuring the emulated cluster ({cluster.spec.nodes} nodes x {per_node}, "
                  f"{cluster.spec.link} links)...", file=sys.stderr, flush=True)
            return measure.cluster_hardware(p, cluster)
    hw = hardware.load(p, args.hardware, ranks=min(args.gpus, 4))
    if args.gpus_per_node:
        hw.gpus_per_node = args.gpus_per_node
    return hw


def table(rows: list[dict[str, Any]], hw: Any, top: int) -> str:
    """The ranked layouts as a Markdown table."""
    gib = 2**30
    lines = [f"| # | layout | memory GiB x {rows[0]['headroom']:.2f} (limit) | margin GiB | step s | compute "
             "| bubble | tp/cp/ep/pp | data par. "
             "| sync | optimizer | tokens/s a GPU | MFU |", "|---:|---|" + "---:|" * 11]
    for i, r in enumerate(rows[:top] if top else rows):
        s = r["step"]
        fit = "" if r["fits"] else " **too big**"
        held = r["peak_memory"] * r["headroom"]
        lines.append(f"| {i + 1} | {r['name']} | {held / gib:.3g} ({hw.memory / gib:.3g}){fit} "
                     f"| {r['margin'] / gib:.3g} "
                     f"| {s['total']:.4g} | {s['compute']:.3g} | {s['bubble']:.3g} | {s['tp_cp_ep_pp']:.3g} "
                     f"| {s['data_parallel']:.3g} | {s['sync']:.3g} | {s['optimizer']:.3g} | {r['tokens_per_gpu']:.4g} "
                     f"| {r['mfu']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Check the options, rank the layouts, print them (or ``--json``) and the best one's command."""
    args = parser().parse_args(argv)
    problem = check(args)
    if problem:
        sys.stderr.write(f"{PROG}: {problem}\n")
        return 2
    p = search.program()
    model = catalog.model(p, args.model, **{k: getattr(args, k) for k in SHAPE if getattr(args, k) is not None})
    gpu = hardware.canonical(args.hardware) is not None
    dtype = args.dtype or ("bf16" if gpu else "float32")
    policy = catalog.policy(p, dtype)
    seq = args.seq or (8192 if args.model.startswith("llama") else 64 if not gpu else 4096)
    hw = hardware_of(p, args)
    progress = None
    candidates = len(search.layouts(p, model, args.gpus, args.global_batch, seq, args.runnable))
    if candidates > 200 and not args.json:
        from tqdm.auto import tqdm
        progress = lambda items: tqdm(items, desc="layouts", file=sys.stderr)  # noqa: E731
    headroom = args.headroom or (published.headroom(p) if gpu else 1.0)
    rows = search.rank(p, model, policy, hw, args.gpus, args.global_batch, seq, args.runnable, progress,
                       headroom=headroom)
    if not rows:
        sys.stderr.write(f"{PROG}: no layout of --model {args.model} divides "
                         f"{args.gpus} GPUs and a batch of {args.global_batch}\n")
        return 2
    if args.json:
        from dataclasses import asdict
        out = [{**{k: v for k, v in r.items() if k != "layout"}, "layout": asdict(r["layout"])}
               for r in rows]
        print(json.dumps({"hardware": asdict(hw), "model": asdict(model), "rows": out}))
        return 0
    print(f"{args.model} on {args.gpus} x {hw.name} ({hw.gpus_per_node} a node), sequence {seq}, "
          f"global batch {args.global_batch}, {len(rows)} layouts, {sum(r['fits'] for r in rows)} fit "
          f"with {headroom:.2f} x the predicted peak")
    print(table(rows, hw, args.top))
    best = rows[0]
    if not best["fits"]:
        print("\nno layout fits in memory")
        return 0
    print(f"\nbest: {best['name']}")
    row, lines, why = render.chosen(rows, hw.gpus_per_node, model, seq, args.global_batch, dtype)
    if why:
        print(f"the capstone's train.py cannot run it: {why}")
    if row is not None:
        print(("run it" if row is best else f"the fastest train.py runs, {row['name']}: run it")
              + " with the capstone's train.py:")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
