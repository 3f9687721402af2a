r"""DiLoCo against DDP on scikit-learn's digits, with torchft: what a sync every H steps costs.

DDP all-reduces the gradients of every step. DiLoCo (Douillard et al. 2023) lets each replica
group take H steps of its own inner optimizer (AdamW) on its own data, then all-reduces the
pseudo-gradient (the parameters at the last sync minus the parameters now) and applies it with
an outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the paper. It moves
DDP's bytes / H. The price is in the loss: this program trains the same model on the same
batches both ways, at equal samples (every group takes --steps inner steps of --batch
samples), and reports the held-out loss of each, for each H of --sync-every.

The replica groups run as threads of this one process, the way torchft's own
local_sgd_integ_test.py runs them: one lighthouse (torchft's LighthouseServer), and per group
a TCPStore, a Manager on torchft's ProcessGroupGloo, and its model. DDP is torchft's
DistributedDataParallel with torchft's Optimizer (a quorum per step); DiLoCo is
torchft.local_sgd.DiLoCo (a quorum per sync). The bytes given to Manager.allreduce are counted.

A check that the comparison is the one it says: DiLoCo with H = 1, outer SGD lr 1 and no
momentum, and an SGD inner optimizer, is DDP with SGD; the two runs' weights agree within
1e-12 (float64; not bitwise: DiLoCo's pseudo-gradient is p - (p - lr g)).

Run:  python diloco_digits.py --steps 400 --sync-every 1 5 20 --lr 3e-3   (2 groups, 400 steps)
      python diloco_digits.py --report diloco.json   (the defaults: H = 5 and 20, AdamW lr 1e-3)
The report (--report FILE, JSON): "checks" (name, ok), and per run ("ddp", "diloco_h<H>"):
"curve" ([inner step, held-out loss] pairs), "loss" (the last), "bytes_per_inner_step",
"seconds"; "diloco_loss_over_ddp_loss_h<H>"; "exact_gap" (the H = 1 check's largest
parameter difference).

Source: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023), its outer Nesterov SGD (lr 0.7, momentum 0.9) and inner AdamW; torchft 0.2.0's
local_sgd.DiLoCo, Manager, DistributedDataParallel, Optimizer and local_sgd_integ_test.py.
"""

import argparse
import json
import os
import sys
import threading
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "error")   # the Manager logs every quorum
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

HIDDEN = 32
TEST = 397   # held-out images of the 1797


def data(seed=0):
    """(train x, train y, test x, test y): the 8x8 digits in float64, a fixed split."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float64) / 16.0, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:TEST], order[TEST:]
    return x[train], y[train], x[test], y[test]


def make_model(seed=0):
    """The model every group starts from (the same on every group: init_sync=False)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)).double()


def batch(train_x, train_y, seed, step, group, groups, size):
    """Group `group`'s batch at (inner) step `step`: drawn from its own shard of the training
    set (every groups-th image), a function of the step and the group only."""
    shard = torch.arange(group, len(train_y), groups)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + group)
    pick = shard[torch.randint(len(shard), (size,), generator=g)]
    return train_x[pick], train_y[pick]


def held_out_loss(model, test_x, test_y):
    with torch.no_grad():
        return F.cross_entropy(model(test_x), test_y).item()


def inner_optimizer(kind, params, lr):
    return torch.optim.AdamW(params, lr=lr) if kind == "adamw" else torch.optim.SGD(params, lr=lr)


def group(g, run, args, lighthouse, store_port, sets, model, out):
    """One replica group: its Manager, its model, --steps inner steps (DDP: one sync each)."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    train_x, train_y, test_x, test_y = sets
    inner = inner_optimizer(run["inner"], model.parameters(), run["lr"])
    timeout = timedelta(seconds=args.timeout)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=args.groups,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      use_async_quorum=False, init_sync=False, replica_id=f"{run['name']}-{g}",
                      store_addr="127.0.0.1", store_port=store_port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout)
    sent = [0]
    allreduce = manager.allreduce

    def counted(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        return allreduce(tensor, *a, **kw)
    manager.allreduce = counted
    curve = []

    def train_step(step, forward, optimizer):
        x, y = batch(train_x, train_y, args.seed, step, g, args.groups, args.batch)
        optimizer.zero_grad()                 # torchft's Optimizer: waits for the quorum
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()                      # DDP: the commit; DiLoCo: every H-th, the sync

    try:
        h = run["h"]
        if h == 0:                            # DDP: torchft's, gradients averaged every step
            forward, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, inner)
            for step in range(args.steps):
                train_step(step, forward, optimizer)
                if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                    curve.append([step + 1, held_out_loss(model, test_x, test_y)])
            syncs = args.steps
        else:
            outer = torch.optim.SGD(model.parameters(), lr=run["outer_lr"],
                                    momentum=run["momentum"], nesterov=run["momentum"] > 0)
            with DiLoCo(manager, [model], inner, outer, sync_every=h,
                        backup_device=torch.device("cpu"), pin_memory=False):
                for step in range(args.steps):
                    train_step(step, model, inner)
                    if (step + 1) % h == 0:   # the parameters every group now holds
                        curve.append([step + 1, held_out_loss(model, test_x, test_y)])
            syncs = args.steps // h
        out[g] = {"curve": curve, "bytes": sent[0], "committed": manager.current_step(),
                  "syncs": syncs, "params": [p.detach().clone() for p in model.parameters()]}
    finally:
        manager.shutdown(wait=False)


def train(run, args, sets=None):
    """Every group of one run, each a thread; the run's result (group 0's curve, bytes, ...)."""
    import time

    from torchft.coordination import LighthouseServer

    sets = sets or data(args.seed)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.groups, join_timeout_ms=100,
                                  heartbeat_timeout_ms=1000)
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                         timeout=timedelta(seconds=args.timeout))
              for _ in range(args.groups)]
    # built here, not in the threads: torch.manual_seed is one generator for the process
    models = [make_model(args.seed) for _ in range(args.groups)]
    out, errors = {}, []

    def one(g):
        try:
            group(g, run, args, lighthouse.address(), stores[g].port, sets, models[g], out)
        except BaseException as error:   # noqa: BLE001 - reported by the main thread
            errors.append(f"group {g}: {type(error).__name__}: {error}")

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(g,), daemon=True) for g in range(args.groups)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.timeout * 10 + args.steps)
        if any(thread.is_alive() for thread in threads):
            errors.append(f"{run['name']}: a group did not finish in time")
    finally:
        lighthouse.shutdown()
    if errors:
        raise RuntimeError("; ".join(errors))
    first = out[0]
    return {"name": run["name"], "curve": first["curve"], "loss": first["curve"][-1][1],
            "bytes_per_inner_step": first["bytes"] / args.steps,
            "seconds": time.monotonic() - started,
            "all_committed": all(o["committed"] == o["syncs"] for o in out.values()),
            "groups_equal": all(torch.equal(a, b) for o in out.values()
                                for a, b in zip(o["params"], first["params"])),
            "params": first["params"]}


def published(h, args):
    return {"name": f"diloco_h{h}", "h": h, "inner": "adamw", "lr": args.lr,
            "outer_lr": args.outer_lr, "momentum": args.outer_momentum}


def exactness(args, outer_lr=1.0, sets=None):
    """DiLoCo H = 1, outer SGD lr `outer_lr`, no momentum, SGD inside, against torchft's DDP
    with SGD: the largest parameter difference after --exact-steps steps."""
    short = argparse.Namespace(**{**vars(args), "steps": args.exact_steps})
    ddp = train({"name": "exact_ddp", "h": 0, "inner": "sgd", "lr": args.sgd_lr}, short, sets)
    h1 = train({"name": "exact_h1", "h": 1, "inner": "sgd", "lr": args.sgd_lr,
                "outer_lr": outer_lr, "momentum": 0.0}, short, sets)
    return max((a - b).abs().max().item() for a, b in zip(ddp["params"], h1["params"]))


def compare(args):
    """The report: DDP, DiLoCo for each H, their ratios, and the checks."""
    torch.set_num_threads(1)
    sets = data(args.seed)
    ddp = train({"name": "ddp", "h": 0, "inner": "adamw", "lr": args.lr}, args, sets)
    runs = {h: train(published(h, args), args, sets) for h in args.sync_every}
    gap = exactness(args, sets=sets)
    checks = [("diloco_h1_lr1_no_momentum_equals_ddp", gap < 1e-12)]
    for h, done in runs.items():
        checks.append((f"bytes_per_inner_step_h{h}_is_ddp_over_h",
                       abs(done["bytes_per_inner_step"] * h / ddp["bytes_per_inner_step"] - 1) < 1e-9))
    every = [ddp, *runs.values()]
    checks.append(("every_sync_committed", all(r["all_committed"] for r in every)))
    checks.append(("groups_end_bitwise_equal", all(r["groups_equal"] for r in every)))
    report = {"checks": [{"name": n, "ok": bool(ok)} for n, ok in checks],
              "groups": args.groups, "steps": args.steps, "batch": args.batch, "lr": args.lr,
              "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
              "exact_gap": gap, "ddp": {k: v for k, v in ddp.items() if k != "params"}}
    for h, done in runs.items():
        report[f"diloco_h{h}"] = {k: v for k, v in done.items() if k != "params"}
        report[f"diloco_loss_over_ddp_loss_h{h}"] = done["loss"] / ddp["loss"]
    return report


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse(argv=None):
    parser = Parser(prog="diloco_digits.py", description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--steps", type=int, default=400,
                        help="inner steps of every group, a multiple of each H (default 400)")
    parser.add_argument("--sync-every", type=int, nargs="+", default=[5, 20], metavar="H",
                        help="DiLoCo's H values (default 5 20)")
    parser.add_argument("--batch", type=int, default=32, help="samples per group and step")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's lr, DDP's and DiLoCo's inner")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr (0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo's outer Nesterov momentum (0.9)")
    parser.add_argument("--sgd-lr", type=float, default=0.1, help="SGD's lr in the H = 1 check")
    parser.add_argument("--exact-steps", type=int, default=20, help="steps of the H = 1 check")
    parser.add_argument("--eval-every", type=int, default=5, help="DDP's held-out loss every K steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=10, help="seconds for every collective")
    parser.add_argument("--report", help="write the report (JSON) here")
    args = parser.parse_args(argv)
    if args.groups < 2:
        parser.error("--groups must be at least 2: one group has nobody to sync with")
    if min(args.steps, args.batch, args.exact_steps, args.eval_every, args.timeout) < 1:
        parser.error("--steps, --batch, --exact-steps, --eval-every and --timeout must be at least 1")
    for h in args.sync_every:
        if h < 1 or args.steps % h:
            parser.error(f"--sync-every {h}: each H must be at least 1 and divide --steps {args.steps}")
    if not (args.lr > 0 and args.outer_lr > 0 and args.sgd_lr > 0 and 0 <= args.outer_momentum < 1):
        parser.error("the learning rates must be positive and --outer-momentum in [0, 1)")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no such directory")
    return args


def main(argv=None):
    args = parse(argv)
    report = compare(args)
    print(f"DDP: held-out loss {report['ddp']['loss']:.4f} after {args.steps} steps of "
          f"{args.groups} x {args.batch} samples ({report['ddp']['seconds']:.1f} s)")
    for h in args.sync_every:
        run = report[f"diloco_h{h}"]
        print(f"DiLoCo H={h}: held-out loss {run['loss']:.4f}, "
              f"{report[f'diloco_loss_over_ddp_loss_h{h}']:.3f} x DDP's; "
              f"bytes per inner step {run['bytes_per_inner_step']:.0f} ({run['seconds']:.1f} s)")
    print(f"DiLoCo H=1, outer lr 1, no momentum vs DDP (SGD): largest difference {report['exact_gap']:.1e}")
    for check in report["checks"]:
        print(f"check: {check['name']}: {'OK' if check['ok'] else 'FAILED'}")
    if args.report:
        with open(f"{args.report}.tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{args.report}.tmp", args.report)
    if not all(check["ok"] for check in report["checks"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
