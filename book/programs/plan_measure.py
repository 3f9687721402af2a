"""This machine's figures for plan_cost.py's Hardware, measured by microbenchmarks only (no
training step): the matmul rate of each shape on one thread (as each rank runs), the memory
bandwidth, the time of one small operation, what a tensor-parallel module adds, the cores
several busy processes get together, and, under torchrun, each link level's alpha, beta and
burst from gloo all-reduces of several sizes.

Run:  python plan_measure.py --measure hw.json --ranks 2 --seconds 0.02   (a quick look: each timing 0.02 s)
      python plan_measure.py --measure hw.json --ranks 4   (matmul rates, bandwidth, overheads, cores)
      torchrun --standalone --nproc-per-node 4 plan_measure.py --sweep hw.json     (one node's link)
      torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --rdzv-endpoint NODE0:29500 \
          plan_measure.py --sweep hw.json                  (on each node K: both link levels)
then  python plan_step.py --hardware hw.json ...          (the prediction)

plan_cost.py (its Hardware) sits beside it: copy both. torch and the standard library only.
--report FILE: JSON with "checks" (every rate measured is positive; the cores within the
busy processes; each link fitted with alpha >= 0 and beta > 0) and "hardware" (the figures
written, the matmul table and the sweep's samples aside).
Source: gloo's all-reduce (torch.distributed) for the links; a tc tbf link passes a burst (its
bucket) at once after a pause, which the fit finds.
"""

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict

import plan_cost
import torch
import torch.distributed as dist


def _timed(fn, seconds):
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def _busy(barrier, out, seconds):
    """One of several processes: the rate of a middle-sized matmul while the others run theirs."""
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    barrier.wait(timeout=60)  # a sibling that never came: BrokenBarrierError, not a hang
    out.put(2 * 256**3 / _timed(lambda: a @ b, seconds))


def _tp_module(seconds):
    """What a tensor-parallel module adds to a forward and backward: a column- and a row-split
    Linear on a mesh of one rank against the same two plain, tiny (its own work is DTensor's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(2, 4, 4)
        pair = [torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
                for _ in range(2)]
        parallelize_module(pair[1], init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
        plain, split = (_timed(lambda m=m: m(x).sum().backward(), 10 * seconds) for m in pair)
        return max(0.0, split - plain) / 2
    finally:
        dist.destroy_process_group()


def measure(path, ranks=1, seconds=0.1):
    """This machine's matmul rate per shape (one thread, as each rank runs), its memory
    bandwidth, the time of one small operation, what a tensor-parallel module adds, and the
    cores `ranks` busy processes get (their matmul rate together over one process's alone):
    written to path (JSON)."""
    torch.set_num_threads(1)
    rows = []
    for m_ in (64, 256, 1024):
        for k in (16, 64, 256, 1024):
            for n in (16, 64, 256, 1024):
                a, b = torch.randn(m_, k), torch.randn(k, n)
                rows.append([m_, k, n, 2 * m_ * k * n / _timed(lambda a=a, b=b: a @ b, seconds)])
    big = torch.randn(2**22)
    bandwidth = 2 * big.numel() * 4 / _timed(lambda: big.mul(1.0001), seconds)
    tiny = torch.randn(8)
    op = _timed(lambda: tiny.add(1.0), seconds)
    cores = 0.0
    if ranks > 1:
        # one process's rate: the best of five windows, so that a window another process
        # shared does not pass for this machine's speed (the busy ranks' rates are shared)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        alone = max(2 * 256**3 / _timed(lambda: a @ b, seconds) for _ in range(5))
        ctx = multiprocessing.get_context("fork")
        barrier, out = ctx.Barrier(ranks), ctx.Queue()
        # daemons: whatever happens here, none outlives this process
        procs = [ctx.Process(target=_busy, args=(barrier, out, 10 * seconds), daemon=True)
                 for _ in range(ranks)]
        for proc in procs:
            proc.start()
        rates = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        cores = sum(rates) / alone
    tp_module = _tp_module(seconds)
    hw = plan_cost.Hardware(name="this-machine", peak=max(r[3] for r in rows), memory=os.sysconf("SC_PAGE_SIZE")
                  * os.sysconf("SC_PHYS_PAGES"), bandwidth=bandwidth, gpus_per_node=64,
                  op_seconds=op, tp_module_seconds=tp_module, matmul=rows, backend="gloo", streams=False,
                  overlap=False,
                  cores=cores, sources={"all": f"measured by plan_measure.py --measure, {time.strftime('%Y-%m-%d')}"})
    if os.path.exists(path):
        with open(path) as f:
            hw.links = json.load(f).get("links", hw.links)
    with open(path, "w") as f:
        json.dump(asdict(hw), f)


def fit(samples):
    """alpha, beta, burst of a link from [(messages in a row, bytes on the link, seconds)] of
    one kind of call: alpha from the three smallest calls (their bytes pass at once, only
    latency is left: the middle one of them), then seconds - messages x alpha = beta x
    max(0, bytes - burst) by least squares for each burst tried (0 and each sampled size but
    the two largest), the best kept. A burst is what a tc tbf link passes at once after a
    pause (its bucket); a real link has none."""
    small = sorted(samples, key=lambda x: x[1])[:3]
    alpha = sorted(t / k for k, _, t in small)[1]  # the middle one of the three smallest calls
    best = None
    for burst in [0.0] + sorted({x[1] for x in samples})[:-2]:
        rows = [(max(0.0, w - burst), t - k * alpha) for k, w, t in samples]
        beta = sum(w * t for w, t in rows) / sum(w * w for w, _ in rows)
        error = sum((beta * w - t) ** 2 for w, t in rows)
        if beta > 0 and (best is None or error < best[0]):
            best = (error, [alpha, beta, burst])
    return best[1]


def sweep(path, repeats=5):
    """Under torchrun: all-reduces of several sizes inside every node at once (the ranks of a
    node share its cores, as in training) and, with several nodes, across them (one rank a
    node, one transfer on each link): alpha, beta and burst of each link level (fit), added
    to path (JSON) by rank 0, which returns True (the others: False)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local
    inside = [dist.new_group(list(range(k * local, (k + 1) * local))) for k in range(nodes)]
    mine = list(range(rank // local * local, (rank // local + 1) * local))
    levels = {"node": (inside[rank // local], mine, (2**10, 2**14, 2**16, 2**18, 2**20, 2**22))}
    if nodes > 1:
        across = list(range(0, world, local))
        levels["net"] = (dist.new_group(across), across,
                         (2**10, 2**14, 2**15, 2**16, 2**17, 2**18, 2**19, 2**20, 2**21))
    found = {}
    for level, (group, ranks, sizes) in levels.items():
        n = len(ranks)
        samples = []
        for size in sizes:
            x = torch.zeros(size // 4)
            times = []
            for _ in range(repeats):
                dist.barrier()
                time.sleep(0.05)  # a pause, as compute makes between collectives
                start = time.perf_counter()
                if rank in ranks and n > 1:
                    dist.all_reduce(x, group=group)
                times.append(time.perf_counter() - start)
            samples.append((2 * (n - 1), 2 * (n - 1) / n * size, sorted(times)[len(times) // 2]))
        found[level] = samples
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return False
    hw = json.load(open(path)) if os.path.exists(path) else asdict(plan_cost.Hardware())
    hw["links"] = {level: fit(samples) for level, samples in found.items() if samples[0][0]}
    hw["sweep"] = found
    hw["links"].setdefault("net", hw["links"].get("node", [0.0, 0.0, 0.0]))
    hw["links"].setdefault("node", hw["links"]["net"])
    hw["gpus_per_node"], hw["collective_seconds"] = local if nodes > 1 else hw.get("gpus_per_node", local), 0.0
    hw.setdefault("sources", {})["links"] = (f"gloo all-reduce sweep, {nodes} node(s) x {local} ranks, "
                                             f"{time.strftime('%Y-%m-%d')}")
    with open(path, "w") as f:
        json.dump(hw, f)
    return True



def measure_checks(hw, ranks):
    """--measure's checks: [(name, ok)]. A rate that is not positive is a broken timing; more
    cores than busy processes (a tenth over for the clock's noise) is a broken measurement."""
    return [("every matmul rate is positive", all(r[3] > 0 for r in hw["matmul"])),
            ("bandwidth and the small operation are positive", hw["bandwidth"] > 0 and hw["op_seconds"] > 0),
            ("the busy processes got at most their own cores", ranks == 1 or 0 < hw["cores"] <= 1.1 * ranks)]


def sweep_checks(hw):
    """--sweep's checks: each link level fitted with a latency that is not negative and a
    positive time a byte."""
    return [(f"the {level} link: alpha >= 0, beta > 0", alpha >= 0 and beta > 0)
            for level, (alpha, beta, *_) in sorted(hw["links"].items())]


def write_report(path, checks, hw):
    """--report FILE: the checks and the figures, written whole (a temporary file, renamed)."""
    report = {"checks": [{"name": name, "ok": bool(ok)} for name, ok in checks],
              "hardware": {k: v for k, v in hw.items() if k not in ("matmul", "sweep")}}
    for name, ok in checks:
        print(f"check: {name}: {'OK' if ok else 'FAILED'}")
    if path:
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{path}.tmp", path)


def refuse(message):
    """Bad input: one line on stderr, exit status 2, nothing started or written."""
    sys.stderr.write(f"plan_measure.py: {message}\n")
    raise SystemExit(2)


def main(argv=None):
    p = argparse.ArgumentParser(prog="plan_measure.py", description=__doc__.splitlines()[0])
    p.error = refuse  # argparse's own errors too
    p.add_argument("--measure", metavar="FILE", help="measure this machine into FILE (JSON)")
    p.add_argument("--sweep", metavar="FILE", help="under torchrun: add each link level to FILE")
    p.add_argument("--ranks", type=int, default=1, help="with --measure: busy processes sharing the cores")
    p.add_argument("--seconds", type=float, default=0.1,
                   help="with --measure: how long each timing runs (default 0.1)")
    p.add_argument("--repeats", type=int, default=5,
                   help="with --sweep: timings of each size, the median kept (default 5)")
    p.add_argument("--report", metavar="FILE", help="write the checks and the figures here (JSON)")
    a = p.parse_args(argv)
    if bool(a.measure) == bool(a.sweep):
        p.error("give one of --measure FILE and --sweep FILE")
    for name in ("measure", "sweep", "report"):
        path = getattr(a, name)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            p.error(f"--{name} {path}: no folder {os.path.dirname(os.path.abspath(path))}")
    if a.measure:
        if a.ranks < 1:
            p.error(f"--ranks {a.ranks}: must be at least 1")
        if not a.seconds > 0:
            p.error(f"--seconds {a.seconds:g}: must be more than 0")
        measure(a.measure, a.ranks, a.seconds)
        with open(a.measure) as f:
            hw = json.load(f)
        return write_report(a.report, measure_checks(hw, a.ranks), hw)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        p.error("--sweep: run it under torchrun (it times all-reduces between the ranks)")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: must be at least 1")
    if sweep(a.sweep, a.repeats):  # rank 0: what it wrote
        with open(a.sweep) as f:
            hw = json.load(f)
        write_report(a.report, sweep_checks(hw), hw)


if __name__ == "__main__":
    sys.exit(main())
