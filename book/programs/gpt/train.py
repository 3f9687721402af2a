"""Train the GPT of model.py on any layout of pipeline, data, context, expert and tensor
parallelism; save a checkpoint any layout can resume from.

Run:  python train.py --steps 20 --log-every 5 --report report.json    (one process; its losses in report.json)
      torchrun --standalone --nproc-per-node 4 train.py --dp-shard 2 --tp 2
      torchrun --standalone --nproc-per-node 8 train.py --pp 2 --dp-shard 2 --tp 2
      torchrun --standalone --nproc-per-node 4 train.py --dp-shard 2 --ep 2 --experts 4

The text is bytes of the Python standard library's own sources (--text names another file).
Every option is checked before a process group exists: a bad one gets one line, exit 2.
With --report FILE rank 0 writes the run as JSON at the end: "losses", "first_step",
"seconds", "layout", "checks" (none: this program prints no check) and, with --cost,
"cost" (the prediction of cost_model.py for every rank, and what every rank counted and
measured with cost_meter.py).
"""

import argparse
import contextlib
import datetime
import glob
import json
import logging
import os
import sys
import sysconfig
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from cost_meter import Meter
from cost_model import predict
from model import GPT, Config, MoE, loss_of, zigzag
from parallelize import (
    Layout,
    build_mesh,
    parallelize,
    problems,
    sum_partial_gradients,
    tie_gradients,
    tie_groups,
)
from torch.distributed.tensor.parallel import loss_parallel

TIMEOUT = datetime.timedelta(seconds=120)
# DTensor logs a warning when a weight sharded over two axes (FSDP x TP) is gathered whole
# in two all-gathers: full_parameters does that once, at the end, for the comparison
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
PROGRAM = "train.py"


def fail(message):
    """One line on stderr (from rank 0 under torchrun), exit status 2, nothing started."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"{PROGRAM}: {message}\n")
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message)


def parse_args(argv=None):
    p = Parser(prog=PROGRAM, description="A small GPT on any parallel layout.")
    for axis in ("pp", "dp-replicate", "cp", "ep", "tp"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1)")
    p.add_argument("--dp-shard", default="1", help="FSDP degree, or auto: the ranks the other "
                   "axes leave (after a restart on fewer ranks, a smaller FSDP)")
    defaults = Config()
    for name in ("dim", "heads", "layers", "seq", "ffn", "experts", "top_k"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads, grouped-query "
                   "attention (default: as many as --heads)")
    p.add_argument("--renormalize", action="store_true", help="divide a token's top-k gates by "
                   "their sum")
    p.add_argument("--aux-loss", type=float, default=defaults.aux_loss, help="weight of the "
                   f"experts' load-balancing loss (default {defaults.aux_loss}; 0: none)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks together")
    p.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches (default 2 x pp)")
    p.add_argument("--schedule", choices=("1F1B", "GPipe"), default="1F1B")
    p.add_argument("--accumulate", type=int, default=1, help="gradient-accumulation steps per step (the "
                   "gradients are reduced after the last; under --pp: more micro-batches)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--bf16", action="store_true", help="FSDP2's mixed precision: parameters "
                   "gathered and used in bfloat16, gradients reduced in float32")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", help="a text file to train on (default: the standard library)")
    p.add_argument("--save", help="a folder: a DCP checkpoint in DIR/step-N after the last step")
    p.add_argument("--save-every", type=int, default=0, help="and every N steps (default: the last only)")
    p.add_argument("--load", help="resume from a checkpoint (any layout's): a step-N folder, or "
                   "the latest complete one in a --save folder")
    p.add_argument("--resume", action="store_true", help="start from the latest complete checkpoint "
                   "in --save if there is one (what a restarted job does)")
    p.add_argument("--out", help="write the final parameters here (a file per stage and expert shard)")
    p.add_argument("--sample", type=int, default=0, help="print this many sampled bytes at the end")
    p.add_argument("--log-every", type=int, default=0, help="print the loss every N steps")
    p.add_argument("--cost", action="store_true", help="print the predicted and the counted "
                   "bytes, memory and FLOPs of a step (cost_model.py, cost_meter.py)")
    p.add_argument("--rate-window", type=float, default=0.0, metavar="SECONDS", help="with --cost: "
                   "before each step every rank times its MLP's matmul for SECONDS, all at once "
                   "(the compute rate the ranks get together; default 0: none)")
    p.add_argument("--report", help="write the losses (and the cost) here as JSON at the end")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    others = args.pp * args.dp_replicate * args.cp * args.ep * args.tp
    if args.dp_shard == "auto":
        if others < 1 or world % others:
            fail(f"--dp-shard auto: {world} ranks do not split into the other axes' {others}")
        args.dp_shard = world // others
    elif args.dp_shard.lstrip("-").isdigit():
        args.dp_shard = int(args.dp_shard)
    else:
        fail(f"--dp-shard {args.dp_shard}: a number, or auto")
    layout = Layout(args.pp, args.dp_replicate, args.dp_shard, args.cp, args.ep, args.tp)
    config = Config(vocab=256, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                    layers=args.layers, seq=args.seq, ffn=args.ffn, experts=args.experts,
                    top_k=args.top_k, renormalize=args.renormalize, aux_loss=args.aux_loss)
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp", "dim", "heads", "layers",
                 "seq", "ffn", "batch", "accumulate", "steps"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if min(args.microbatches, args.save_every, args.sample, args.log_every, args.clip, args.aux_loss) < 0:
        fail("--microbatches, --save-every, --sample, --log-every, --clip and --aux-loss: must not "
             "be negative")
    if args.rate_window and not (args.cost and 0 < args.rate_window <= 60):
        fail(f"--rate-window {args.rate_window:g}: more than 0 and at most 60 (seconds), with --cost")
    if args.bf16 and args.dtype != "float32":
        fail(f"--bf16 with --dtype {args.dtype}: the parameters bfloat16 is cast from are float32")
    if not args.lr > 0:
        fail(f"--lr {args.lr}: must be greater than 0")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        fail(f"--dim {args.dim}: must split into {args.heads} heads of an even width")
    if args.kv_heads < 0 or args.kv_heads and args.heads % args.kv_heads:
        fail(f"--kv-heads {args.kv_heads}: must divide the {args.heads} heads")
    if args.experts and not 1 <= args.top_k <= args.experts:
        fail(f"--top-k {args.top_k}: between 1 and --experts {args.experts}")
    args.microbatches = args.microbatches or 2 * layout.pp
    found = problems(layout, config, world, args.microbatches if layout.pp > 1 else 1, args.batch)
    if found:
        fail(found[0])
    if args.text and not os.path.isfile(args.text):
        fail(f"--text {args.text}: no such file")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        fail(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    if args.resume:
        if not args.save or args.load:
            fail("--resume: needs --save (the folder to resume from) and no --load")
        args.load = args.save if checkpoints(args.save) else None
    if args.load:
        args.load = latest(args.load)
        saved = read_meta(args.load)
        if saved["config"] != asdict(config):
            diff = [f"{k} {saved['config'][k]} (not {v})" for k, v in asdict(config).items()
                    if saved["config"].get(k) != v]
            fail(f"--load {args.load}: a checkpoint of another model: {', '.join(diff)}")
        if saved["step"] >= args.steps:
            fail(f"--load {args.load}: already {saved['step']} steps; --steps {args.steps} adds none")
    for name in ("save", "load"):
        if getattr(args, name) and layout.ep > 1:
            fail(f"--{name} with --ep {layout.ep}: checkpoints of spread experts are not supported")
    if args.save and checkpoints(args.save) and not (
            args.load and os.path.dirname(args.load) == os.path.normpath(args.save)):
        fail(f"--save {args.save}: it holds checkpoints already; resume with --load "
             f"{args.save}, or save elsewhere (this program never replaces one)")
    return args, layout, config


def checkpoints(folder):
    """The complete checkpoints in a --save folder, oldest first (meta.json is written last)."""
    if not os.path.isdir(folder):
        return []
    steps = sorted(name for name in os.listdir(folder) if name.startswith("step-"))
    return [os.path.join(os.path.normpath(folder), n) for n in steps
            if os.path.isfile(os.path.join(folder, n, "meta.json"))]


def latest(path):
    if os.path.isfile(os.path.join(path, "meta.json")):
        return os.path.normpath(path)
    found = checkpoints(path)
    if not found:
        fail(f"--load {path}: no complete checkpoint there")
    return found[-1]


def read_meta(path):
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        fail(f"--load {path}: not a checkpoint of this program ({error.__class__.__name__})")


def text_bytes(path, limit=2_000_000):
    """The training text as bytes: a file, or the standard library's sources in name order."""
    if path:
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    chunks, size = [], 0
    for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(name, "rb") as f:
            chunks.append(f.read())
        size += len(chunks[-1])
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def batch_of(data, step, args, seq):
    """The whole batch of a step (the same on every rank): a function of the step alone, so
    the data position to resume from is the step number."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (args.batch * args.accumulate,), generator=g)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


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


def unwrap(name):
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(wrapper, "")
    return name


def gradient_sync(stage, last):
    """Reduce the gradients in this backward pass only if it is the step's last: before
    it, FSDP2 and DDP add each micro-step's gradients up where they are (chapter 8)."""
    if isinstance(stage, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else stage.no_sync()
    if hasattr(stage, "set_requires_gradient_sync"):  # FSDP2 (HSDP: its all-reduce too)
        stage.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def clip_grad_norm(stage, max_norm, layout, mesh):
    """torch.nn.utils.clip_grad_norm_ of the whole model, whatever the layout.

    torch.nn.utils.get_total_norm adds up the gradients of one mesh: on DTensors (FSDP's
    shards, TP's) it knows which mesh dimensions hold pieces and which hold copies, and
    full_tensor() sums the pieces. Two sums it cannot see are done by hand: the experts
    (each "ep" rank holds other experts, as plain tensors, on a mesh of their own) and the
    pipeline stages (each holds other layers). The tied embedding is counted once, on
    the first stage (the last holds the same gradient: tie_gradients).
    """
    from torch.distributed.tensor import DTensor

    def squared_norm(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        return norm.double() ** 2

    dense, experts = [], []  # torch computes on one mesh at a time: the experts have their own
    for name, p in stage.named_parameters():
        if p.grad is not None:
            (experts if layout.ep > 1 and ".experts." in name else dense).append(p)
    tied_copy = layout.pp > 1 and inner(stage).outputs and not inner(stage).embeds
    counted = [p for p in dense if not (tied_copy and p is inner(stage).tok_emb.weight)]
    device = next(stage.parameters()).device
    total = squared_norm(counted) if counted else torch.zeros((), dtype=torch.float64, device=device)
    if experts:
        expert_total = squared_norm(experts)
        if layout.ep > 1:
            dist.all_reduce(expert_total, group=mesh["ep"].get_group())
        total = total + expert_total
    if layout.pp > 1:
        dist.all_reduce(total, group=mesh["pp"].get_group())
    norm = total.sqrt()
    for params in (dense, experts):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()


def whole(t):
    """A plain tensor: a DTensor's full value (the loss under loss_parallel is replicated)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def inner(stage):
    return stage.module if isinstance(stage, torch.nn.parallel.DistributedDataParallel) else stage


def full_parameters(stage):
    """Every parameter of this stage as a whole tensor (DTensors gathered: every rank calls)."""
    out = {}
    for name, p in stage.named_parameters():
        t = p.detach()
        out[unwrap(name)] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu()
    return out


def state_of(stage, optimizer, step):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(stage, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step),
            "rng": torch.get_rng_state()}


def save(folder, stage, optimizer, step, config, layout, losses):
    """DIR/step-N: DCP's files, then meta.json (the model, the layout, every loss so far)."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(folder, f"step-{step:06d}")
    dcp.save(state_of(stage, optimizer, step), checkpoint_id=path)
    if dist.get_rank() == 0:  # written last, and whole: a folder without it is not a checkpoint
        with open(os.path.join(path, "meta.json.tmp"), "w") as f:
            json.dump({"config": asdict(config), "step": step, "layout": asdict(layout),
                       "losses": losses}, f)
        os.replace(os.path.join(path, "meta.json.tmp"), os.path.join(path, "meta.json"))


def load(path, stage, optimizer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = state_of(stage, optimizer, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(stage, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def main():
    args, layout, config = parse_args()
    device = rank_device()
    torch.set_default_dtype(getattr(torch, args.dtype))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=TIMEOUT)
    else:  # python train.py: a group of one, so that every path is the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=TIMEOUT)
    mesh = build_mesh(layout, device.type, TIMEOUT)
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # the same whole model on every rank, then each keeps its part
    model = GPT(config)
    stage = parallelize(model, layout, mesh, device, args.checkpoint_activations, args.compile,
                        args.bf16)
    part = inner(stage)
    for module in stage.modules():  # the load-balancing loss, as a share of the step's loss
        if isinstance(module, MoE):  # (a mean over the step's sequences, averaged like it)
            module.aux_scale = config.aux_loss * layout.cp / (args.batch * args.accumulate
                                                              // layout.data_parallel)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr, weight_decay=0.1)
    first = load(args.load, stage, optimizer) if args.load else 0
    history = read_meta(args.load)["losses"] if args.load else []  # the steps before this run
    tie = tie_groups(mesh, layout, TIMEOUT)
    pp_rank = mesh["pp"].get_local_rank()
    # the rows of this rank's samples: its place among the data-parallel ranks, whose
    # coordinates are (dp_replicate, dp_shard, ep); the cp ranks of one place share the rows
    dp_rank = ((mesh["dp_replicate"].get_local_rank() * layout.dp_shard
                + mesh["dp_shard"].get_local_rank()) * layout.ep + mesh["ep"].get_local_rank())
    cp_rank = mesh["cp"].get_local_rank()
    rows = args.batch // layout.data_parallel
    # the tokens of this rank's samples: two chunks of each under context parallelism
    cols = zigzag(cp_rank, layout.cp, config.seq) if layout.cp > 1 else torch.arange(config.seq)
    # under TP the logits are split by vocabulary over the tp ranks: loss_parallel computes
    # the cross-entropy (and its backward) from the pieces, with no rank holding them all
    parallel_loss = loss_parallel if layout.tp > 1 else contextlib.nullcontext
    schedule = None
    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        scale = args.microbatches * args.accumulate  # micro-batches a step; a loss's share
        pipe = PipelineStage(stage, pp_rank, layout.pp, device, group=mesh["pp"].get_group())
        cls = Schedule1F1B if args.schedule == "1F1B" else ScheduleGPipe
        schedule = cls(pipe, scale, loss_fn=lambda out, y: loss_of(out, y) / scale,
                       scale_grads=False)
    data = text_bytes(args.text)
    losses = []
    started = time.perf_counter()
    prediction = predict(config, layout, args, device.type) if args.cost else None  # this device's
    meter = Meter(config, layout, args, stage, optimizer, prediction, enabled=args.cost)
    for step in range(first, args.steps):
        meter.begin(step)
        x_all, y_all = batch_of(data, step, args, config.seq)
        total = torch.zeros((), dtype=torch.float64, device=device)
        # this rank's rows of each accumulation step, and its chunk of their tokens
        mine = [slice((a * layout.data_parallel + dp_rank) * rows,
                      (a * layout.data_parallel + dp_rank + 1) * rows) for a in range(args.accumulate)]
        xs = [x_all[r][:, cols].to(device) for r in mine]
        ys = [y_all[r][:, cols].to(device) for r in mine]
        with parallel_loss():
            if schedule is None:
                for a, (x, y) in enumerate(zip(xs, ys)):
                    with gradient_sync(stage, last=a == args.accumulate - 1):
                        loss = loss_of(stage(x), y) / args.accumulate
                        loss.backward()
                    total += whole(loss.detach()).double()
            else:  # the accumulation steps are more micro-batches of one schedule, which
                # reduces the gradients once, after the last
                parts = []
                schedule.step(torch.cat(xs) if part.embeds else None,
                              target=torch.cat(ys) if part.outputs else None, losses=parts)
                if part.outputs:
                    total += whole(torch.stack(parts).sum().detach()).double()
        sum_partial_gradients(stage)
        tie_gradients(part, tie)
        norm = clip_grad_norm(stage, args.clip, layout, mesh) if args.clip else None
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total, group=mesh["loss"].get_group())
        total /= mesh["loss"].size()
        if layout.pp > 1:  # the last stage has it: every stage gets it
            if not part.outputs:
                total.zero_()
            dist.all_reduce(total, group=mesh["pp"].get_group())
        losses.append(total.item())
        meter.end(step)
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(args.save, stage, optimizer, step + 1, config, layout, history + losses)
        if args.log_every and rank == 0 and (step + 1) % args.log_every == 0:
            extra = f", gradient norm {norm:.3f}" if norm is not None else ""
            print(f"step {step + 1}: loss {losses[-1]:.4f}{extra}", flush=True)
    seconds = time.perf_counter() - started
    counted = meter.report()
    if args.out:
        write_out(args.out, stage, mesh)
    if args.save:
        save(args.save, stage, optimizer, args.steps, config, layout, history + losses)
    if args.sample and rank == 0 and layout.world == 1:
        print(sample(part, data, args.sample, config, device), flush=True)
    if args.report and rank == 0:
        write_report(args.report, {"program": PROGRAM, "checks": [], "losses": history + losses,
                                   "first_step": first, "seconds": seconds, "layout": asdict(layout),
                                   **({"cost": counted} if args.cost else {})})
    dist.destroy_process_group()


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)


def write_out(path, stage, mesh):
    """This stage's whole parameters (one rank per stage and expert shard): what the
    one-process run is compared with."""
    params = full_parameters(stage)
    os.makedirs(path, exist_ok=True)
    coords = [mesh[a].get_local_rank() for a in ("dp_replicate", "dp_shard", "cp", "tp")]
    if not any(coords):
        pp, ep = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
        torch.save(params, os.path.join(path, f"params-pp{pp}-ep{ep}.pt"))


@torch.no_grad()
def sample(model, data, count, config, device, temperature=0.8):
    """Bytes the trained model writes after a prompt from the text."""
    g = torch.Generator().manual_seed(1)
    tokens = data[:config.seq // 2].long().to(device)[None]
    for _ in range(count):
        logits = model(tokens[:, -config.seq:])[0, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits.float(), -1).cpu(), 1, generator=g).to(device)
        tokens = torch.cat([tokens, nxt[None]], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
    # Everything is written and the group destroyed. Leave without the interpreter's teardown:
    # on the CPU, gloo's threads can abort it (SIGABRT) while it frees the sharded model.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
