"""Every pipeline schedule of torch.distributed.pipelining, checked against one process.

A stack of identical residual blocks (x + tanh(W x + b), float64) is cut into equal
stages. GPipe and 1F1B give each rank one stage; the looped schedules (Interleaved1F1B,
LoopedBFS, InterleavedZeroBubble) give rank r the stages r and r + p, the V-shaped ones
(ZBVZeroBubble, DualPipeV) the stages r and 2p - 1 - r. Every rank also builds the whole
model and runs the whole batch in one process; after each step it compares the loss
and every parameter's gradient of its stages with that one process.

For each schedule a rank prints one line: the largest gradient and loss differences,
and the activations its stages held at the peak (in chunks: one micro-batch through one
stage). With --time N, N timed steps follow the checked ones: each rank records when
each of its forwards and backwards (F, B, I, W) starts and ends, on a clock started at a
barrier before the step (on CUDA, events recorded on the compute stream), and rank 0
prints the median step's bubble. The step runs from the first compute on any rank to
the last; whatever of it a rank does not compute, it idles (waits for an input, sends,
receives, runs the schedule's own code); the bubble is idle over busy time, all ranks
together. --pin-cores gives each rank a core of its own and
one thread, so that what a rank waits for is the schedule; on Linux each rank then also
reads how much CPU time other processes took on its core during the step (/proc/stat, less
its own), since their work passes for a bubble. With --dp 2 the ranks form a
(pp, dp) mesh: each pipeline runs half of the batch and FSDP2 shards every stage over the
dp dimension. With --report FILE rank 0 also writes it all as JSON: "checks" (one per
check line: name, schedule, microbatches, ok), "runs" (per schedule and micro-batch
count, every rank's numbers and spans, and with --time a "timed" summary: every step's
bubble, busy and idle seconds per rank and the others' time on its core, the median step, and the
median seconds per chunk of each kind and stage) and "skipped".

Run:  torchrun --standalone --nproc-per-node=2 pipeline_schedules.py --microbatches 3 4   (every schedule)
      torchrun --standalone --nproc-per-node=4 pipeline_schedules.py --schedule ZBVZeroBubble
      torchrun --standalone --nproc-per-node=4 pipeline_schedules.py --dp 2 --schedule 1F1B DualPipeV
      torchrun --standalone --nproc-per-node=2 pipeline_schedules.py --pin-cores --time 5 \
          --microbatches 4 --blocks 32 --microbatch-size 256 --width 1024

Sources: no single article covers them. The schedules are torch 2.14.1's own
(torch/distributed/pipelining/schedules.py, after the papers their docstrings name);
its documentation lists them, and here each one runs on real processes and is held to
one process's gradients, with the micro-batch counts each constructor refuses checked
before anything starts.
"""

import argparse
import copy
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, schedules

SINGLE = ("GPipe", "1F1B")  # one stage per rank
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # stages r, r + p
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # stages r, 2p - 1 - r
SCHEDULES = SINGLE + LOOPED + V_SHAPED


def stages_of(schedule: str, rank: int, pp: int) -> list[int]:
    """The stage indices a rank holds (2 per rank except for GPipe and 1F1B)."""
    if schedule in SINGLE:
        return [rank]
    if schedule in LOOPED:
        return [rank, rank + pp]
    return [rank, 2 * pp - 1 - rank]


def refusal(schedule: str, pp: int, m: int) -> str | None:
    """Why the library's schedule refuses m micro-batches on pp ranks (None: it accepts).

    The rules of torch 2.14.1's constructors: Schedule1F1B needs m >= p; the
    interleaved ones split m into max(1, m // p) rounds that must divide m;
    DualPipeV needs one micro-batch per stage at least (m >= 2p).
    """
    if schedule == "1F1B" and m < pp:
        return f"1F1B needs at least as many micro-batches as ranks ({pp}), got {m}"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"{schedule} runs max(1, m // {pp}) = {rounds} rounds, which must divide "
                    f"the {m} micro-batches")
    if schedule == "DualPipeV" and m < 2 * pp:
        return f"DualPipeV needs at least as many micro-batches as stages ({2 * pp}), got {m}"
    return None


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=torch.float64)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


def build_model(blocks: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(blocks)))


def batch(step: int, size: int, width: int):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(size, width, generator=g, dtype=torch.float64),
            torch.randn(size, width, generator=g, dtype=torch.float64))


class ActivationMeter:
    """Bytes of activations autograd holds for backward: the saved tensors of shape
    (micro-batch, width), not the weights (FSDP2 gathers them into new tensors)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)
        self.held = self.peak = 0

    def pack(self, t):
        if t.shape != self.shape:
            return t
        return _Held(t, self)

    @staticmethod
    def unpack(held):
        return held if isinstance(held, torch.Tensor) else held.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor, meter):
        self.tensor, self.meter, self.nbytes = tensor, meter, tensor.numel() * tensor.element_size()
        meter.held += self.nbytes
        meter.peak = max(meter.peak, meter.held)

    def __del__(self):
        self.meter.held -= self.nbytes


def synchronize(device):
    """Wait for the work queued on the device: a CUDA kernel returns before it has run, so a
    timer that does not wait measures its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device):
    """Now, on the clock the spans are read on: the CPU's, or on CUDA an event recorded on the
    compute stream (it marks when the kernels queued before it have run)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds_between(start, end):
    """Seconds from one clock() to another; events are read once the step is done (synchronised)."""
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def time_compute(stage, spans, device):
    """Append (kind, stage, start, end) to spans for each forward (F), full backward (B),
    backward-input (I) and backward-weight (W) of a stage, each end a clock().

    On CUDA the two ends are events on the compute stream, not torch.cuda.synchronize():
    that waits for every stream of the device, NCCL's too, so a span would count the
    receives the schedule posted ahead and the sends its peer has not taken yet."""
    kinds = {"forward_one_chunk": lambda kw: "F", "backward_weight_one_chunk": lambda kw: "W",
             "backward_one_chunk": lambda kw: "B" if kw.get("full_backward", True) else "I"}
    for name, kind in kinds.items():
        method = getattr(stage, name)

        def timed(*args, _method=method, _kind=kind, **kwargs):
            start = clock(device)
            try:
                return _method(*args, **kwargs)
            finally:
                spans.append((_kind(kwargs), stage.stage_index, start, clock(device)))
        setattr(stage, name, timed)


def others_on_my_core():
    """CPU seconds so far of other processes on the one core this rank is pinned to (Linux
    /proc/stat: the core's busy time, less this process's own), or None (not pinned, not Linux)."""
    cores = os.sched_getaffinity(0)
    if len(cores) != 1:
        return None
    try:
        with open("/proc/stat") as f:
            line = next(line for line in f if line.startswith(f"cpu{next(iter(cores))} "))
    except (OSError, StopIteration):
        return None
    user, nice, system, _, _, irq, softirq, steal = (int(x) for x in line.split()[1:9])
    own = os.times()  # every thread of this process, gloo's included
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK") - own.user - own.system


def bubble_of_step(ranks_spans):
    """Idle over busy time of one step, all ranks together, from each rank's compute spans.

    Each rank's clock starts at the barrier before the step, so the ranks' spans line up.
    The step runs from the first compute on any rank to the last; what a rank does not
    compute of it, it idles (waits for an input, sends, receives, the schedule's own code).
    """
    spans = [s for rank in ranks_spans for s in rank]
    first, last = min(s[2] for s in spans), max(s[3] for s in spans)
    busy = [sum(end - start for *_, start, end in rank) for rank in ranks_spans]
    idle = [last - first - b for b in busy]
    return {"seconds": last - first, "busy": busy, "idle": idle, "bubble": sum(idle) / sum(busy)}


def costs_of(ranks_spans):
    """The median seconds of each kind of compute (F, B, I, W) per stage, over all ranks."""
    found = {}
    for kind, stage, start, end in (s for rank in ranks_spans for s in rank):
        found.setdefault(f"{kind}{stage}", []).append(end - start)
    return {key: sorted(values)[len(values) // 2] for key, values in sorted(found.items())}


def run_schedule(args, name, m, rank, mesh, device):
    """Train 2 steps under one schedule; return this rank's line and whether it matched."""
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    indices = stages_of(name, pp_rank, pp)
    n_stages = pp * len(indices)
    per_stage = args.blocks // n_stages
    model = build_model(args.blocks, args.width).to(device)
    reference = copy.deepcopy(model)
    parts = [model[i * per_stage:(i + 1) * per_stage] for i in indices]  # names stay "0".."7"
    if dp > 1:
        from torch.distributed.fsdp import fully_shard
        for part in parts:  # reshard_after_forward=False: one all-gather per step, not per micro-batch
            fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
    stages = [PipelineStage(part, i, n_stages, device, group=mesh["pp"].get_group())
              for part, i in zip(parts, indices)]
    local = args.microbatch_size * m  # samples of this pipeline
    def mse(out, target):
        return (out - target).pow(2).sum() / (local * args.width)

    def loss_fn(out, target):  # saved tensors of the loss are not activations of a block
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return mse(out, target)
    cls = schedules.get_schedule_class(name)
    schedule = cls(stages if name not in SINGLE else stages[0], m, loss_fn=loss_fn,
                   scale_grads=False)  # the loss is already divided by the whole batch
    meter = ActivationMeter((args.microbatch_size, args.width))
    spans = []  # this step's compute: (kind, stage, start, end)
    for stage in stages:
        time_compute(stage, spans, device)
    worst_grad = worst_loss = 0.0
    timed = []  # per timed step: this rank's spans on a clock started at the barrier before it
    for step in range(args.steps + args.time):
        x, y = (t.to(device) for t in batch(step, local * dp, args.width))
        x.requires_grad_()  # stage 0 computes its input's gradient too: every stage costs the same
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        for part in parts:
            part.zero_grad()
        losses = []
        meter.held = meter.peak = 0
        spans.clear()
        dist.barrier()  # every rank starts its clock here, so that their spans line up
        synchronize(device)
        start, others = clock(device), others_on_my_core()
        with meter.hooks():
            schedule.step(x[mine] if 0 in indices else None,
                          target=y[mine] if n_stages - 1 in indices else None, losses=losses)
        synchronize(device)  # the whole step, its transfers included: every event has been reached
        if step >= args.steps:  # timed steps: no comparison
            if others is not None:
                others = others_on_my_core() - others
            timed.append({"spans": [(k, i, seconds_between(start, a), seconds_between(start, b))
                                    for k, i, a, b in spans], "others_on_core": others})
            continue
        reference.zero_grad()
        reference_loss = (reference(x) - y).pow(2).mean()
        reference_loss.backward()
        for part in parts:
            for pname, p in part.named_parameters():
                grad = p.grad.full_tensor() if dp > 1 else p.grad
                ref = reference.get_parameter(pname.replace("._fsdp_wrapped_module", "")).grad
                worst_grad = max(worst_grad, (grad - ref).abs().max().item())
        if n_stages - 1 in indices:
            loss = torch.stack(losses).sum().detach()
            if dp > 1:
                dist.all_reduce(loss, group=mesh["dp"].get_group())
                loss /= dp
            worst_loss = max(worst_loss, abs(loss - reference_loss).item())
    chunk = 2 * per_stage * args.microbatch_size * args.width * 8  # linear input, tanh output
    line = (f"[rank {rank}] {name} m={m} stages {','.join(map(str, indices))}: "
            f"max gradient difference {worst_grad:.1e}")
    if n_stages - 1 in indices:
        line += f", loss difference {worst_loss:.1e}"
    line += f"; peak activations {meter.peak / chunk:g} chunks"
    found = {"rank": rank, "stages": indices, "max_gradient_difference": worst_grad,
             "loss_difference": worst_loss if n_stages - 1 in indices else None,
             "peak_activation_chunks": meter.peak / chunk}
    if args.time:
        found["timed"] = timed
    return line, max(worst_grad, worst_loss) <= args.tolerance, found


def rank_device() -> torch.device:
    """This rank's GPU, or the CPU where ranks would have to share one (nccl refuses that).

    GPU LOCAL_RANK when this machine shows one per local rank; cuda:0 when the launcher
    left this rank exactly one (CUDA_VISIBLE_DEVICES names one device: srun --gpus-per-task=1,
    torchrun --virtual-local-rank). A torchrun worker other than local rank 0 that sees one
    listed GPU shares it (torchrun passes its CUDA_VISIBLE_DEVICES to every worker
    unchanged): refused in one line, since rank 0 takes that GPU with nccl.
    """
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if gpus == 1 and len(visible) == 1:
        if local_rank > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            print(f"{gpus} GPU visible to every one of {local_ranks} local ranks: nccl needs a GPU "
                  "of its own for each rank (run one rank per GPU, give each its own with torchrun "
                  "--virtual-local-rank, or hide it with CUDA_VISIBLE_DEVICES= to run on the CPU)",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def main(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.pin_cores:  # a core and a thread per rank: its waits are the schedule's, not the machine's
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"])]})
        torch.set_num_threads(1)
    device = rank_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    pp = world // args.dp
    mesh = init_device_mesh(device.type, (pp, args.dp), mesh_dim_names=("pp", "dp"))
    all_ok, report = True, {"program": "pipeline_schedules.py", "world": world, "pp": pp,
                            "dp": args.dp, "checks": [], "runs": [], "skipped": []}
    for name in (SCHEDULES if "all" in args.schedule else args.schedule):
        for m in args.microbatches:
            why = refusal(name, pp, m)
            if why is not None:  # only with --schedule all: a named schedule was refused before
                if rank == 0:
                    print(f"skip: {why}", flush=True)
                report["skipped"].append(why)
                continue
            line, ok, found = run_schedule(args, name, m, rank, mesh, device)
            print(line + "\n", end="", flush=True)  # one write, so the ranks' lines never mix
            verdict = torch.tensor([ok], dtype=torch.int, device=device)
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # every rank must agree
            all_ok &= bool(verdict.item())
            ranks = [None] * world
            dist.all_gather_object(ranks, found)  # every rank's numbers, for --report
            report["runs"].append({"schedule": name, "microbatches": m, "ranks": ranks})
            if args.time:
                report["runs"][-1]["timed"] = timed = summarise_timed(ranks)
                if rank == 0:
                    costs = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in timed["costs"].items())
                    others = max((o for step in timed["steps"] for o in step["others_on_core"]
                                  if o is not None), default=None)
                    print(f"timed: {name} m={m}: step {timed['seconds'] * 1e3:.1f} ms, bubble (idle over "
                          f"busy, all ranks) {timed['bubble']:.3f}; ms per chunk {costs}"
                          + ("" if others is None else f"; other processes on a rank's core {others * 1e3:.0f} ms"),
                          flush=True)
            report["checks"].append({"name": f"{name} on {pp} ranks x dp {args.dp}, m={m}",
                                     "schedule": name, "microbatches": m, "ok": bool(verdict.item()),
                                     "tolerance": args.tolerance})
            if rank == 0:
                print(f"check: {name} on {pp} ranks x dp {args.dp}, m={m}, matches one process "
                      f"within {args.tolerance:g}: {'OK' if verdict.item() else 'FAILED'}", flush=True)
    if args.report and rank == 0:
        write_report(args.report, report)
    dist.destroy_process_group()
    return 0 if all_ok else 1


def summarise_timed(ranks):
    """Every timed step's bubble from all ranks' spans, the median step, and the costs per chunk."""
    steps = [bubble_of_step([r["timed"][i]["spans"] for r in ranks]) | {
             "others_on_core": [r["timed"][i]["others_on_core"] for r in ranks]}
             for i in range(len(ranks[0]["timed"]))]
    median = sorted(steps, key=lambda s: s["bubble"])[len(steps) // 2]
    return {"seconds": median["seconds"], "bubble": median["bubble"], "steps": steps,
            "costs": costs_of([step["spans"] for r in ranks for step in r["timed"]])}


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv=None):
    parser = Parser(description="Pipeline schedules checked against one process.")
    parser.add_argument("--schedule", nargs="+", default=["all"], choices=(*SCHEDULES, "all"),
                        metavar="NAME", help=f"some of {', '.join(SCHEDULES)}, or all (default)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4],
                        help="micro-batch counts, each run in turn (default 4)")
    parser.add_argument("--microbatch-size", type=int, default=2, help="samples (default 2)")
    parser.add_argument("--blocks", type=int, default=8, help="identical blocks (default 8)")
    parser.add_argument("--width", type=int, default=16, help="features (default 16)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--steps", type=int, default=2, help="checked steps (default 2)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="pin each local rank to a core of its own, with one thread")
    parser.add_argument("--time", type=int, default=0, help="timed steps after them (default 0)")
    parser.add_argument("--tolerance", type=float, default=1e-10, help="default 1e-10")
    parser.add_argument("--report", help="also write the checks and every rank's numbers here, as JSON")
    args = parser.parse_args(argv)
    for name in ("microbatch_size", "blocks", "width", "dp", "steps", "tolerance"):
        if not 0 < getattr(args, name) < float("inf"):
            parser.error(f"argument --{name.replace('_', '-')}: expected a value > 0, "
                         f"got {getattr(args, name)}")
    if args.microbatch_size == args.width:
        parser.error("--microbatch-size must differ from --width (activations are told from weights by shape)")
    if args.time < 0 or min(args.microbatches) < 1:
        parser.error("argument --time and --microbatches: expected values >= 0 and >= 1")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if "LOCAL_RANK" not in os.environ:
        parser.error(f"start me with torchrun --standalone --nproc-per-node=2 {parser.prog}")
    world = int(os.environ["WORLD_SIZE"])
    if world % args.dp or world // args.dp < 2:
        parser.error(f"--dp {args.dp} leaves no pipeline of 2 ranks or more in {world} ranks")
    local, cores = int(os.environ["LOCAL_WORLD_SIZE"]), len(os.sched_getaffinity(0))
    if args.pin_cores and local > cores:
        parser.error(f"--pin-cores: {local} ranks on this machine, {cores} cores to pin them to")
    pp = world // args.dp
    if args.blocks % (2 * pp):
        parser.error(f"--blocks {args.blocks}: cannot cut into {2 * pp} equal stages")
    for name in args.schedule if "all" not in args.schedule else ():
        for m in args.microbatches:
            why = refusal(name, pp, m)
            if why is not None:
                parser.error(why)
    return args


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
