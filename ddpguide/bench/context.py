"""Context parallelism: time, memory, balance and bytes of the chapter's ring attention.

``python -m ddpguide.bench context [--quick] [--json FILE]``

Every case runs the program ``book/programs/ring_attention.py`` itself (imported by
path), in fresh processes of one thread each, one after another in one run, at a
sequence length where attention is the whole step (forward and backward):

* ``ring_over_full_time_2ranks``: ring attention on 2 ranks (slowest rank) over full
  attention (math kernel) in one process, median wall time, interleaved rounds;
* ``ring_peak_over_full_2ranks``: peak activation bytes per rank over one process's,
  counted by :class:`ddpguide.context.memory.LiveBytes`;
* ``zigzag_busiest_over_mean`` and ``contiguous_busiest_over_mean``: causal mask on 4
  ranks; CPU time each rank spends in its block products (``time.thread_time``, the least
  of the repeats), the busiest rank over the mean;
* ``ulysses_bytes_over_ring_bytes``: bytes each rank sends, forward and backward, on 4
  ranks (4 heads, so that Ulysses applies), as the program counts them; the formula is
  ``8(N-1)/N / (6N-4)``.
"""

from __future__ import annotations

import statistics
import time

import torch

from ddpguide.bench.report import Report
from ddpguide.context.memory import SHAPE, full_attention_peak, ring_peak_worker
from ddpguide.context.program import PROGRAM, busiest_over_mean, bytes_formula
from ddpguide.core.ranklog import progress
from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn


def _inputs(seq: int, seed: int, heads: int = SHAPE["heads"], dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shape = (SHAPE["batch"], heads, seq, SHAPE["head_dim"])
    tensors = [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(4)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(tensors)]


def time_worker(seq: int, repeats: int) -> float:
    """Median seconds of forward + backward: ring attention on the ranks, or full on one."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    program, world = programs.load(PROGRAM), dist.get_world_size()
    q, k, v, dout = _inputs(seq // world, dist.get_rank())
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        dist.barrier()
        start = time.perf_counter()
        if world == 1:
            with sdpa_kernel(SDPBackend.MATH):
                F.scaled_dot_product_attention(q, k, v, is_causal=False).backward(dout)
        else:
            program.RingAttention.apply(q, k, v, "contiguous", False).backward(dout)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def balance_worker(seq: int, split: str, repeats: int) -> dict:
    """CPU seconds this rank spends in block products, causal; bytes sent by each method."""
    import torch.distributed as dist

    program, world = programs.load(PROGRAM), dist.get_world_size()
    spent = [0.0]
    originals = {name: getattr(program, name) for name in ("merge_block", "grad_block")}

    def timed(function):
        def run(*args):
            start = time.thread_time()
            result = function(*args)
            spent[0] += time.thread_time() - start
            return result
        return run

    for name, function in originals.items():
        setattr(program, name, timed(function))
    per_repeat = []
    try:
        q, k, v, dout = _inputs(seq // world, dist.get_rank())
        for _ in range(repeats + 1):  # the first one warms up
            spent[0] = 0.0
            program.RingAttention.apply(q, k, v, split, True).backward(dout)
            per_repeat.append(spent[0])
    finally:
        for name, function in originals.items():
            setattr(program, name, function)
    sent = {}
    a, b, c, grad = _inputs(seq // world, dist.get_rank(), heads=world)  # Ulysses: heads % N == 0
    for method in ("ring", "ulysses"):
        program.SENT["bytes"] = 0
        out = (program.ulysses_attention(a, b, c, True) if method == "ulysses"
               else program.RingAttention.apply(a, b, c, "contiguous", True))
        out.backward(grad)
        sent[method] = program.SENT["bytes"]
    # the least over the repeats: CPU time only grows when other processes share the core
    return {"cpu_s": min(per_repeat[1:]), "sent": sent,
            "local_bytes": a.numel() * a.element_size()}


def run(quick: bool = False) -> Report:
    """Measure every case (see the module docstring) and return the report."""
    seq = 1024 if quick else 2048
    repeats, rounds = (2, 1) if quick else (5, 3)
    report = Report("context")
    details = {"batch": SHAPE["batch"], "heads": SHAPE["heads"], "head dim": SHAPE["head_dim"],
               "sequence": seq, "threads per rank": 1}

    def measured(name, value, unit, **more):
        report.add(name, value, unit, **details, **more)
        print(f"{name}: {value:.4g} {unit}", flush=True)

    steps = [("time", r) for r in range(rounds)] + [("memory", 0), ("balance", 0)]
    ring_times, full_times = [], []
    for kind, round_ in progress(steps, enabled=True, desc="context", unit="case"):
        if kind == "time":  # interleaved: a burst of load hits both sides of a round alike
            full = spawn(time_worker, 1, seq, repeats, threads_per_rank=1, echo=False,
                         timeout=600)[0]
            ring = max(spawn(time_worker, 2, seq, repeats, threads_per_rank=1, echo=False,
                             timeout=600))
            full_times.append(full)
            ring_times.append(ring)
            measured(f"full attention, 1 process, round {round_ + 1}", full * 1e3, "ms")
            measured(f"ring attention, 2 ranks, round {round_ + 1}", ring * 1e3, "ms")
            report.add_ratio("ring_over_full_time_2ranks",
                             [r / f for r, f in zip(ring_times, full_times)])
        elif kind == "memory":
            full_peak = full_attention_peak(seq, causal=False)
            ring_peak = max(p[0] for p in spawn(ring_peak_worker, 2, [seq], False,
                                                threads_per_rank=1, echo=False, timeout=600))
            measured("peak activation memory, 1 process", full_peak / 2 ** 20, "MiB",
                     method="LiveBytes")
            measured("peak activation memory per rank, ring, 2 ranks", ring_peak / 2 ** 20,
                     "MiB", method="LiveBytes")
            report.ratios["ring_peak_over_full_2ranks"] = ring_peak / full_peak
        else:
            by_split = {}
            for split in ("zigzag", "contiguous"):
                ranks = spawn(balance_worker, 4, seq, split, repeats, threads_per_rank=1,
                              echo=False, timeout=600)
                cpu = [r["cpu_s"] for r in ranks]
                by_split[split] = ranks
                for rank, seconds in enumerate(cpu):
                    measured(f"causal, {split}, 4 ranks: block products of rank {rank}",
                             seconds * 1e3, "ms CPU")
                report.ratios[f"{split}_busiest_over_mean"] = busiest_over_mean(cpu)
            sent = by_split["zigzag"][0]["sent"]
            measured("bytes sent per rank, ring, 4 ranks", sent["ring"], "B")
            measured("bytes sent per rank, Ulysses, 4 ranks", sent["ulysses"], "B")
            local = by_split["zigzag"][0]["local_bytes"]
            report.ratios["ulysses_bytes_over_ring_bytes"] = sent["ulysses"] / sent["ring"]
            formula = bytes_formula("ulysses", 4, local) / bytes_formula("ring", 4, local)
            report.notes.append(f"bytes: the formula gives 8(N-1)/N / (6N-4) = {formula:.3f} "
                                "at N = 4")
    report.notes.append(
        "time: both ranks compute on the 2 cores, and the ring waits for every transfer at the "
        "end of a step; on CPU a transfer is a copy through gloo that the same cores do")
    report.notes.append(
        "balance: on CPU a diagonal block is computed whole with a mask, so the contiguous "
        "split's busiest/mean is 2N/(N+1) = 1.6 in time, against (2N-1)/N = 1.75 counted "
        "with a causal kernel's half block")
    return report
