r"""Per-step fault tolerance with torchft: replica groups that drop out and heal from a peer.

Chapter 4 recovers the torchrun way: one worker dies, every worker stops, and the new
group reloads the last checkpoint. Here the job is split into replica groups that
train the same model on different data. A lighthouse (torchft's Rust server, run
inside this driver) forms a quorum of the live groups before every step; the
gradients are averaged over the groups in the quorum only; and a step is applied
(committed) only when every group of the quorum says its all-reduce went well. A
group that dies is dropped from the next quorum and the others go on. When it is
started again it asks the lighthouse to join, finds that it is behind, and copies
the model and optimizer from a live peer (the "heal") before it takes part.

The driver checks its options, starts the lighthouse
and one TCPStore per replica group, starts each group as a process, starts a
killed group again, and writes the steps of every group to --report. Each worker
is one rank of one group: torchft's ProcessGroupGloo between the groups, its
Manager (state dict callbacks for the heal), its DistributedDataParallel and its
Optimizer wrapper. The model and the data are float64, generated from --seed.

Failures are injected with --kill-group G --at STEP [--where W]:
  step       G's process exits after its backward, before it votes on the commit;
  allreduce  G's process exits inside Manager.allreduce, before its gradient leaves
             (the other groups are waiting inside theirs);
  heal       G exits inside step STEP, and its replacement exits again inside its
             heal (after receiving the peer's state, before loading it).
A killed group is replaced by a spare process that has already imported torch and
waits (a hot spare): the same replica id, a new process, nothing in memory.

Run:
  python ft_train.py --groups 2 --steps 12 --kill-group 1 --at 5 --report ft.json

Source: torchft 0.2.0 (its Manager, ProcessGroupGloo, DistributedDataParallel, Optimizer and
DiLoCo, and its own tests manager_integ_test.py and local_sgd_integ_test.py); no seed article
covers it.
"""

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import socket
import tempfile
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "error")   # the lighthouse and Manager log every quorum
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

KILLED = 17          # exit status of a process killed on purpose
WHERE = ("step", "allreduce", "heal")
# Every group's process is forked from one server that has imported torch and torchft
# once: a new process (a spare) is ready in a fraction of a second, not after an import.
FORKS = multiprocessing.get_context("forkserver")
DIMS = (10, 10, 5)   # input, hidden, output: chapter 4's ToyModel


def make_model(seed):
    """The model every group starts from (the same on every group: init_sync=False)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(),
                         nn.Linear(DIMS[1], DIMS[2])).double()


def batch(seed, step, group, size=8):
    """The batch of replica group `group` at step `step`: a function of both, nothing else."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + group)
    x = torch.randn(size, DIMS[0], generator=g, dtype=torch.float64)
    y = torch.randn(size, DIMS[2], generator=g, dtype=torch.float64)
    return x, y


def digest(model):
    """sha256 of the parameters' bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def tolerant_ddp(manager, model, torchft_hook=False):
    """torchft's DistributedDataParallel, with a comm hook that survives a failed all-reduce.

    torchft 0.2.0's own hook (torchft/ddp.py, _comm_hook) returns work.get_future()._fut.
    When the peer dies inside the all-reduce, the Manager's work.wait() catches gloo's
    "Connection closed by peer", records the error and returns False before it builds
    that future, and the hook fails with `assert fut._fut` (AssertionError): the survivor
    dies too. This hook returns the bucket unchanged instead; the Manager has the error,
    so the step is not committed and is tried again in a new quorum.
    """
    from torchft import DistributedDataParallel

    class TolerantDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            reduced = getattr(work.get_future(), "_fut", None) if work.wait() else None
            if reduced is not None:
                return reduced
            failed = torch.futures.Future()
            failed.set_result(bucket.buffer())
            return failed

    return (DistributedDataParallel if torchft_hook else TolerantDDP)(manager, model)


def worker(args):
    """One replica group of one rank: train until the Manager's step reaches --steps."""
    import warnings

    from torchft import Manager, Optimizer, ProcessGroupGloo
    warnings.filterwarnings("ignore", message=".*(find_unused_parameters|not writable)")

    timeout = timedelta(seconds=args.timeout)
    model = make_model(args.seed)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.incarnation > 0:                         # a spare: imported, waiting for its turn
        store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False,
                              timeout=timedelta(seconds=args.deadline))
        store.set(f"ready{args.incarnation}", "1")
        store.wait([f"start{args.incarnation}"])
    die_where, _, die_at = (args.die or "none:-1").partition(":")
    die_at = int(die_at)

    def die(where):
        out.write(json.dumps({"event": "killed", "group": args.group, "where": where,
                              "incarnation": args.incarnation,
                              "step": manager.current_step(), "time": time.time()}) + "\n")
        out.flush()
        os._exit(KILLED)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        if die_where == "heal":
            die("heal")
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        records.append({"event": "healed", "step": manager.current_step(), "time": time.time(),
                        "weights": digest(model)})

    records = []
    out = open(args.log, "a", buffering=1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict,
        use_async_quorum=False, init_sync=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        replica_id=args.replica_id, store_addr="127.0.0.1", store_port=args.store_port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1")
    if args.incarnation == 0:                        # the first start: every group together
        store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False,
                              timeout=timedelta(seconds=args.deadline))
        store.set("ready0", "1")
        store.wait(["go"])

    sent = count_bytes(manager)
    if args.diloco:
        return train_diloco(args, manager, model, inner, out, sent)
    ddp = tolerant_ddp(manager, model, args.torchft_hook)
    optimizer = Optimizer(manager, inner)
    if die_where == "allreduce":
        start_allreduce = manager.allreduce

        def die_in_allreduce(tensor, *a, **kw):   # the peers are already inside theirs
            if manager.current_step() == die_at:
                die("allreduce")
            return start_allreduce(tensor, *a, **kw)
        manager.allreduce = die_in_allreduce

    try:
        while manager.current_step() < args.steps:
            optimizer.zero_grad()                    # waits for the quorum (and heals)
            step = manager.current_step()
            out.write(json.dumps({"event": "contributed", "group": args.group, "step": step,
                                  "quorum": manager._quorum_id}) + "\n")
            x, y = batch(args.seed, step, args.group)
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()                          # the all-reduce runs in here
            if die_where == "step" and step == die_at:
                die("step")
            optimizer.step()                         # commits only if every group agrees
            committed = manager.current_step() == step + 1
            for r in records:
                out.write(json.dumps(dict(r, group=args.group)) + "\n")
            records.clear()
            row = {"event": "step", "group": args.group, "incarnation": args.incarnation,
                   "step": step, "quorum": manager._quorum_id,
                   "participants": manager.num_participants(),
                   "committed": committed, "loss": loss.item(), "bytes": sent[0],
                   "weights": digest(model), "time": time.time()}
            out.write(json.dumps(row) + "\n")
            time.sleep(args.step_seconds)            # stands in for a longer step
            print(f"group {args.group} step {step:3d} quorum {row['quorum']} "
                  f"participants {row['participants']} committed {committed}", flush=True)
        write_final(out, args, manager, model)
    finally:
        out.close()
        manager.shutdown(wait=False)


def write_final(out, args, manager, model):
    out.write(json.dumps({"event": "final", "group": args.group, "step": manager.current_step(),
                          "weights": digest(model),
                          "params": [p.detach().flatten().tolist() for p in model.parameters()]})
              + "\n")


def count_bytes(manager):
    """Count the bytes this group hands to the Manager's all-reduce (DDP's buckets, DiLoCo's
    pseudo-gradients: every cross-group byte goes through Manager.allreduce)."""
    sent = [0]
    start_allreduce = manager.allreduce

    def counted(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        return start_allreduce(tensor, *a, **kw)
    manager.allreduce = counted
    return sent


def train_diloco(args, manager, model, inner, out, sent):
    """DiLoCo (torchft.local_sgd.DiLoCo): --diloco H inner steps on the group's own data, then
    one all-reduce of the pseudo-gradient (parameters at the last sync minus now) and one outer
    SGD step (--outer-lr, --outer-momentum). The Manager's step counts the syncs."""
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum)
    inner_step = 0
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.diloco,
                    backup_device=torch.device("cpu"), pin_memory=False):
            while manager.current_step() < args.steps:
                x, y = batch(args.seed, inner_step, args.group)
                inner.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                inner.step()                         # every H-th: the sync and the outer step
                out.write(json.dumps({"event": "inner", "group": args.group, "inner": inner_step,
                                      "step": manager.current_step(), "loss": loss.item(),
                                      "bytes": sent[0], "time": time.time()}) + "\n")
                inner_step += 1
        write_final(out, args, manager, model)
    finally:
        out.close()
        manager.shutdown(wait=False)


def lighthouse_reachable(addr, seconds=2.0):
    """True when something accepts a TCP connection at addr (http://host:port)."""
    hostport = addr.split("//", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
            return True
    except (OSError, ValueError):
        return False


def check(args, parser):
    """Every option checked before anything starts: one line, exit 2."""
    ids = args.replica_ids.split(",") if args.replica_ids else [
        f"group{g}" for g in range(args.groups)]
    if args.groups < 1:
        parser.error("--groups must be at least 1")
    if len(ids) != args.groups:
        parser.error(f"--replica-ids names {len(ids)} groups, --groups is {args.groups}")
    if len(set(ids)) != len(ids):
        parser.error(f"replica id used twice: {sorted(i for i in ids if ids.count(i) > 1)[0]}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if (args.kill_group is None) != (args.at is None):
        parser.error("--kill-group and --at go together")
    if args.kill_group is not None:
        if not 0 <= args.kill_group < args.groups:
            parser.error(f"--kill-group {args.kill_group} is not a group (0..{args.groups - 1})")
        if not 0 <= args.at < args.steps:
            parser.error(f"--at {args.at} is not a step (0..{args.steps - 1})")
        if args.groups < 2:
            parser.error("--kill-group needs --groups 2 or more: a survivor to heal from")
    if args.chaos and args.kill_group is not None:
        parser.error("--chaos and --kill-group do not go together")
    if args.chaos < 0 or args.chaos_gap < 1:
        parser.error("--chaos must be 0 or more and --chaos-gap 1 or more")
    if args.chaos and args.groups < 2:
        parser.error("--chaos needs --groups 2 or more: a survivor to heal from")
    if args.diloco < 0:
        parser.error("--diloco must be 0 (DDP) or a number of inner steps")
    if args.diloco and (args.chaos or args.kill_group is not None):
        parser.error("--diloco runs without injected failures")
    if args.lighthouse and not lighthouse_reachable(args.lighthouse):
        parser.error(f"lighthouse {args.lighthouse} cannot be reached")
    if args.report and not os.path.isdir(os.path.dirname(os.path.abspath(args.report))):
        parser.error(f"--report {args.report}: no such directory")
    return ids


def plan_kills(args):
    """The kills as [group, step, where]: --kill-group/--at, or --chaos N drawn from --seed.

    Chaos kills come at least --chaos-gap steps apart, so that a killed group has
    rejoined before the next kill, and never in the last --chaos-gap steps."""
    if args.kill_group is not None:
        return [[args.kill_group, args.at, args.where]]
    rng = random.Random(args.seed)
    kills, step = [], 0
    for _ in range(args.chaos):
        step += rng.randint(args.chaos_gap, 2 * args.chaos_gap)
        if step >= args.steps - args.chaos_gap:
            break
        kills.append([rng.randrange(args.groups), step, rng.choice(WHERE)])
    return kills


def deaths(kills, group):
    """What each incarnation of `group` does: die at WHERE:STEP, or nothing.

    A kill "heal" is two deaths: inside step STEP, then inside the replacement's heal."""
    out = []
    for g, step, where in kills:
        if g == group:
            out += [f"step:{step}", "heal:-1"] if where == "heal" else [f"{where}:{step}"]
    return out


def start_group(args, group, replica_id, store_port, lighthouse, incarnation, log, die):
    """Start one replica group's process, forked from a server that has imported torchft.

    Incarnation 0 is the group's first process; incarnation k > 0 is a spare that waits
    until the driver sets start<k> in the group's store."""
    work = argparse.Namespace(**vars(args))
    work.__dict__.update(group=group, replica_id=replica_id, store_port=store_port,
                         lighthouse=lighthouse, incarnation=incarnation, log=log, die=die)
    process = FORKS.Process(target=worker, args=(work,), name=f"{replica_id}.{incarnation}")
    process.start()
    return process


def drive(args, ids):
    """Lighthouse, stores, groups; replace a killed group; collect the steps into a report."""
    from torchft.coordination import LighthouseServer

    deadline = time.monotonic() + args.deadline
    kills = plan_kills(args)
    lighthouse = None
    if args.lighthouse:
        address = args.lighthouse
    else:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000,
                                      heartbeat_timeout_ms=1000)
        address = lighthouse.address()
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=args.timeout)) for _ in ids]
    procs, spares, exits, rows = {}, {}, {}, []
    plans = [deaths(kills, g) for g in range(len(ids))]

    def start(g, k):
        die = plans[g][k] if k < len(plans[g]) else None
        return start_group(args, g, ids[g], stores[g].port, address, k, logs[g], die)

    def stop_all():
        for p in list(procs.values()) + [p for ps in spares.values() for p in ps]:
            if p.exitcode is None:
                p.kill()
            p.join()

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stack.callback(stop_all)
        logs = [os.path.join(tmp, f"group{g}.jsonl") for g in range(len(ids))]
        incarnation = [0] * len(ids)
        for g in range(len(ids)):                     # a spare for every planned death
            procs[g] = start(g, 0)
            spares[g] = [start(g, k) for k in range(1, len(plans[g]) + 2)]
        for g, store in enumerate(stores):            # every Manager up, every spare imported
            store.wait([f"ready{k}" for k in range(len(plans[g]) + 2)],
                       timedelta(seconds=max(1.0, deadline - time.monotonic())))
        for store in stores:
            store.set("go", "1")
        t0 = time.time()
        while procs:
            if time.monotonic() > deadline:
                raise SystemExit(f"ft_train: not done after {args.deadline} s; stopped")
            for g, p in list(procs.items()):
                rc = p.exitcode
                if rc is None:
                    continue
                del procs[g]
                if rc != KILLED:
                    exits[g] = rc
                    continue
                incarnation[g] += 1                   # the spare takes over
                print(f"group {g} killed; spare {incarnation[g]} takes over", flush=True)
                procs[g] = spares[g].pop(0) if spares[g] else start(g, incarnation[g])
                stores[g].set(f"start{incarnation[g]}", "1")
            time.sleep(0.05)
        stop_all()
        for log in logs:
            with open(log) as f:
                rows += [json.loads(line) for line in f]
    if lighthouse is not None:
        lighthouse.shutdown()
    report = {"groups": len(ids), "replica_ids": ids, "steps": args.steps, "seed": args.seed,
              "lr": args.lr, "planned_kills": kills, "start": t0, "exit_codes": exits}
    for event in ("step", "inner", "contributed", "killed", "healed", "final"):
        report[event] = [r for r in rows if r["event"] == event]
    if args.report:
        with open(args.report + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.report + ".tmp", args.report)
    bad = {g: rc for g, rc in exits.items() if rc != 0}
    if bad:
        raise SystemExit(f"ft_train: groups exited with {bad}")
    print(f"done: {len(report['final'])} groups at step {args.steps}, "
          f"{len(report['killed'])} kills, {len(report['healed'])} heals, "
          f"final weights {sorted({r['weights'] for r in report['final']})}")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="steps to commit (default 12)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="sleep this long in every step (default 0.1)")
    parser.add_argument("--kill-group", type=int, help="the group to kill")
    parser.add_argument("--at", type=int, help="the step at which it dies")
    parser.add_argument("--where", choices=WHERE, default="step")
    parser.add_argument("--diloco", type=int, default=0, metavar="H",
                        help="DiLoCo with H inner steps per sync instead of DDP (default 0: DDP)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD lr")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="DiLoCo's outer SGD momentum (default 0)")
    parser.add_argument("--chaos", type=int, default=0,
                        help="instead: N kills of random groups, steps and places (from --seed)")
    parser.add_argument("--chaos-gap", type=int, default=10,
                        help="steps between chaos kills, at least (default 10)")
    parser.add_argument("--replica-ids", help="comma-separated (default group0,group1,...)")
    parser.add_argument("--lighthouse", help="use a running lighthouse (http://host:port)")
    parser.add_argument("--timeout", type=int, default=10,
                        help="seconds for every collective, quorum and heal (default 10)")
    parser.add_argument("--deadline", type=float, default=120,
                        help="seconds the whole run may take (default 120)")
    parser.add_argument("--report", help="write every step of every group here (JSON)")
    parser.add_argument("--torchft-hook", action="store_true",
                        help="use torchft's own DDP comm hook (fails when a peer dies)")
    args = parser.parse_args(argv)
    ids = check(args, parser)
    FORKS.set_forkserver_preload(["torch", "torchft"])
    drive(args, ids)


if __name__ == "__main__":
    main()
