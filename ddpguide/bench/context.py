"""Context parallelism: time, memory, balance and bytes of the chapter's ring attention.

``python -m ddpguide.bench context [--quick] [--json FILE]``

Every case runs the program ``book/programs/ring_attention.py`` itself (imported by
path), in fresh processes of one thread each, one after another in one run, at a
sequence length where attention is the whole step (forward and backward):

* ``ring_over_full_time_2ranks``: ring attention on 2 ranks (slowest rank) over full
  attention (math kernel) in one process, median wall time, interleaved rounds;
* ``ring_peak_over_full_2ranks``: peak activation bytes per rank over one process's,
  counted by :class:`ddpguide.context.memory.LiveBytes`;
* ``zigzag_busiest_over_mean`` and ``contiguous_busiest_over_mean``: causal mask on 2
  ranks, each pinned to a core of its own; each rank's own CPU time in its block products
  (``time.thread_time``, the least of the repeats), the busiest rank over the mean;
  ``..._step_busiest_over_mean`` the same for the whole forward and backward;
* ``ulysses_bytes_over_ring_bytes``: bytes each rank sends, forward and backward, on 4
  ranks (4 heads, so that Ulysses applies), as the program counts them; the formula is
  ``8(N-1)/N / (6N-4)``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ddpguide.bench.report import Report
from ddpguide.context.memory import SHAPE, full_attention_peak, ring_peak_worker
from ddpguide.context.program import PROGRAM, busiest_over_mean, bytes_formula
from ddpguide.core.ranklog import progress
from ddpguide.core.runtime import CPU_BACKEND
from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn

#: the balance is measured on as many ranks as this machine has cores for (one each)
BALANCE_RANKS = 2


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


def _pin_to_own_core(turn: int = 0) -> None:
    """One core of this machine per rank (the ranks of a spawn on one machine, one thread each);
    the ranks swap cores from one ``turn`` to the next, so that a slower core slows each alike."""
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0) if turn == 0 else _CORES)
    _CORES[:] = cores
    os.sched_setaffinity(0, {cores[(dist.get_rank() + turn) % len(cores)]})


_CORES: list[int] = []  # the cores the rank could run on before it was pinned


def balance_worker(seq: int, split: str, repeats: int) -> dict:
    """This rank's own CPU seconds (``time.thread_time``), causal, after a warm-up: the sum over
    its block products of each one's least time over the repeats (a burst of load inflates some
    products of some repeats, not the least), and the least time of the whole forward and backward.
    The ranks swap cores between repeats."""
    import torch.distributed as dist

    program, world = programs.load(PROGRAM), dist.get_world_size()
    spent: list[float] = []  # this repeat's block products, in the order they ran
    originals = {name: getattr(program, name) for name in ("merge_block", "grad_block")}

    def timed(function):
        def run(*args):
            start = time.thread_time()
            result = function(*args)
            spent.append(time.thread_time() - start)
            return result
        return run

    for name, function in originals.items():
        setattr(program, name, timed(function))
    blocks, steps = [], []
    try:
        q, k, v, dout = _inputs(seq // world, dist.get_rank())
        for turn in range(repeats + 1):  # the first one warms up
            _pin_to_own_core(turn)
            spent.clear()
            dist.barrier()
            start = time.thread_time()
            program.RingAttention.apply(q, k, v, split, True).backward(dout)
            steps.append(time.thread_time() - start)
            blocks.append(list(spent))
    finally:
        for name, function in originals.items():
            setattr(program, name, function)
    return {"cpu_s": sum(min(each) for each in zip(*blocks[1:])), "step_cpu_s": min(steps[1:]),
            "block_products": len(blocks[0])}


def bytes_worker(seq: int) -> dict:
    """Bytes this rank sends, forward and backward, causal, ring and Ulysses (heads = ranks)."""
    import torch.distributed as dist

    program, world = programs.load(PROGRAM), dist.get_world_size()
    sent = {}
    a, b, c, grad = _inputs(seq // world, dist.get_rank(), heads=world)  # Ulysses: heads % N == 0
    for method in ("ring", "ulysses"):
        program.SENT["bytes"] = 0
        out = (program.ulysses_attention(a, b, c, True) if method == "ulysses"
               else program.RingAttention.apply(a, b, c, "contiguous", True))
        out.backward(grad)
        sent[method] = program.SENT["bytes"]
    return {"sent": sent, "local_bytes": a.numel() * a.element_size()}


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
            full = spawn(time_worker, 1, seq, repeats, threads_per_rank=1, backend=CPU_BACKEND, echo=False,
                         timeout=600)[0]
            ring = max(spawn(time_worker, 2, seq, repeats, threads_per_rank=1, backend=CPU_BACKEND, echo=False,
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
                                                threads_per_rank=1, backend=CPU_BACKEND, echo=False, timeout=600))
            measured("peak activation memory, 1 process", full_peak / 2 ** 20, "MiB",
                     method="LiveBytes")
            measured("peak activation memory per rank, ring, 2 ranks", ring_peak / 2 ** 20,
                     "MiB", method="LiveBytes")
            report.ratios["ring_peak_over_full_2ranks"] = ring_peak / full_peak
        else:
            for split in ("zigzag", "contiguous"):  # 2 ranks, each on a core of its own
                ranks = spawn(balance_worker, BALANCE_RANKS, seq, split, 2 * repeats, threads_per_rank=1,
                              backend=CPU_BACKEND, echo=False, timeout=600)
                for rank, found in enumerate(ranks):
                    measured(f"causal, {split}, {BALANCE_RANKS} ranks: block products of rank {rank}",
                             found["cpu_s"] * 1e3, "ms CPU")
                    measured(f"causal, {split}, {BALANCE_RANKS} ranks: forward + backward of rank {rank}",
                             found["step_cpu_s"] * 1e3, "ms CPU")
                report.ratios[f"{split}_busiest_over_mean"] = busiest_over_mean([r["cpu_s"] for r in ranks])
                report.ratios[f"{split}_step_busiest_over_mean"] = busiest_over_mean(
                    [r["step_cpu_s"] for r in ranks])
            sent = spawn(bytes_worker, 4, seq, threads_per_rank=1, backend=CPU_BACKEND, echo=False, timeout=600)[0]
            measured("bytes sent per rank, ring, 4 ranks", sent["sent"]["ring"], "B")
            measured("bytes sent per rank, Ulysses, 4 ranks", sent["sent"]["ulysses"], "B")
            report.ratios["ulysses_bytes_over_ring_bytes"] = sent["sent"]["ulysses"] / sent["sent"]["ring"]
            formula = (bytes_formula("ulysses", 4, sent["local_bytes"])
                       / bytes_formula("ring", 4, sent["local_bytes"]))
            report.notes.append(f"bytes: the formula gives 8(N-1)/N / (6N-4) = {formula:.3f} "
                                "at N = 4")
    report.notes.append(
        "time: both ranks compute on the 2 cores, and the ring waits for every transfer at the "
        "end of a step; on CPU a transfer is a copy through gloo that the same cores do")
    report.notes.append(
        f"balance: {BALANCE_RANKS} ranks, each pinned to a core of its own with one thread (they swap "
        "cores between repeats); each rank's own CPU time (time.thread_time: waiting for a transfer "
        "or for a core does not count): per block product the least over the repeats, summed. The "
        "head-tail split gives every rank the same products; the contiguous split gives rank 1 a "
        "full block and a diagonal one against rank 0's diagonal one, (2N-1)/N = 3/2 counted with "
        "a causal kernel's half block, 2N/(N+1) = 4/3 with whole blocks of equal cost; a masked "
        "diagonal block costs more than a full one here (the mask), so the measured figure is "
        "lower. With 4 ranks on 2 cores a rank computes at most half of the time and its CPU time "
        "grows with what shares its core: balance is measured at 2")
    return report
