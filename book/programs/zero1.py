"""ZeRO stage 1: DDP for the gradients, ZeroRedundancyOptimizer for Adam's state.

Run:  torchrun --standalone --nproc-per-node=2 zero1.py
      torchrun --standalone --nproc-per-node=2 zero1.py --report report.json
                (rank 0 also writes the check and every rank's share as JSON: "checks",
                 with the difference and the bytes of Adam state, and "ranks", what each owns)

Every rank keeps the whole model and, after DDP's all-reduce (P -> B), the
whole gradient. Adam's two moments, 8 bytes per parameter in float32, are kept
only by the rank that owns the parameter: ZeroRedundancyOptimizer gives each
rank whole parameter tensors, about 1/N of them. After its local Adam step each
rank broadcasts the parameters it owns, so all replicas stay equal. The program
checks that against one process trained on the full batch.

Source: PyTorch's ZeroRedundancyOptimizer documentation and the ZeRO paper (no source article covers sharding).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

# float64 makes the comparison with one process tight (1e-12); training normally uses float32.
torch.set_default_dtype(torch.float64)
STEPS, BATCH, LR = 3, 12, 0.05


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


def state_bytes(optimizer):
    """Bytes of the tensors an optimizer keeps (Adam: exp_avg, exp_avg_sq, step)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


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


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr (from rank 0 only) and exit status 2
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10)  # torchrun stops every worker once one exits: let rank 0 say why first
        raise SystemExit(2)


def parse_args(argv=None):
    """Checked before any process group: where the report goes must exist."""
    parser = Parser(prog="zero1.py", description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="also write the check and every rank's share here, as JSON")
    args = parser.parse_args(argv)
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no folder {os.path.dirname(os.path.abspath(args.report))}")
    return args


def write_report(path, report):
    """--report FILE: the JSON written whole (a temporary file, then renamed over FILE)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(f"{path}.tmp", path)


def main(args):
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(BATCH, 6, generator=generator).to(device)
    targets = torch.randn(BATCH, 3, generator=generator).to(device)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's samples

    model = DDP(make_model().to(device))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()  # DDP all-reduces
        optimizer.step()  # Adam on this rank's parameters, then a broadcast of each parameter

    # optimizer.optim is the plain Adam that updates only this rank's parameters.
    names = {id(p): name for name, p in model.module.named_parameters()}
    owned = [names[id(p)] for group in optimizer.optim.param_groups for p in group["params"]]
    # One write per line: torchrun runs python -u, where print() writes the text and the
    # newline separately, and the other rank's line could land between the two.
    print(f"[rank {rank}] owns {', '.join(owned)}: Adam state {state_bytes(optimizer.optim)} bytes\n",
          end="", flush=True)
    shares = [None] * world
    dist.all_gather_object(shares, {"rank": rank, "owns": owned, "adam_state_bytes": state_bytes(optimizer.optim)})

    # The same training in one process on the full batch, with plain Adam.
    reference = make_model().to(device)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=LR)
    for _ in range(STEPS):
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()
        reference_optimizer.step()
    difference = max((p - q).abs().max().item()
                     for p, q in zip(model.module.parameters(), reference.parameters()))
    total = torch.tensor([state_bytes(optimizer.optim)], device=device)
    dist.all_reduce(total)  # the ranks' shares add up to one full Adam state

    ok = difference <= 1e-12 and total.item() == state_bytes(reference_optimizer)
    if rank == 0:
        print(f"one process keeps {state_bytes(reference_optimizer)} bytes of Adam state; "
              f"the {world} ranks together keep {total.item()}")
        name = f"ZeRO-1 on {world} ranks equals one process on the full batch"
        print(f"check {'passed' if ok else 'FAILED'}: {name}, max |difference| {difference:.1e} <= 1e-12")
        if args.report:
            write_report(args.report, {
                "program": "zero1.py", "world": world, "ranks": shares,
                "checks": [{"name": name, "ok": ok, "difference": difference, "tolerance": 1e-12,
                            "adam_state_bytes": {"ranks together": int(total.item()),
                                                 "one process": state_bytes(reference_optimizer)}}]})
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main(parse_args())
