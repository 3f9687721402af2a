r"""Per-step fault tolerance with torchft: replica groups that drop out and heal from a peer.

Chapter 4 recovers the torchrun way: one worker dies, every worker stops, and the new
group reloads the last checkpoint. Here the job is split into replica groups that
train the same model on different data. A lighthouse (torchft's Rust server, run
inside this driver) forms a quorum of the live groups before every step; the
gradients are averaged over the groups in the quorum only; and a step is applied
(committed) only when every rank of a group says its all-reduces went well. A
group that dies is dropped from the next quorum and the others go on. When it is
started again it asks the lighthouse to join, finds that it is behind, and copies
the model and optimizer from a live peer (the "heal") before it takes part.

The driver checks its options, starts the lighthouse and one TCPStore per replica
group, starts each group's ranks as processes, starts a killed group again, and
writes the steps of every rank to --report. Each worker is one rank of one group,
with torchft's ProcessGroupGloo between the groups and its Manager (state dict
callbacks for the heal) and Optimizer wrapper. With --group-size 1 (the default) a
group is one process under torchft's DistributedDataParallel. With --group-size 2 a
group is two processes with a gloo process group of their own, and the model is
sharded over them with FSDP2 (fully_shard): FT-HSDP. FSDP2 reduce-scatters the
gradients inside the group, and its all-reduce hook averages each rank's gradient
shard over the same rank of the other groups, through the Manager. The model and
the data are float64, generated from --seed.

Failures are injected with --kill-group G --at STEP [--where W]; every rank of G dies,
the first time it is at W in step STEP or later with every group in the quorum:
  step        after its backward, before it votes on the commit;
  allreduce   inside Manager.allreduce, before its gradient leaves (the other groups
              are waiting inside theirs);
  heal        after its backward, and the replacement dies again inside its heal
              (after receiving the peer's state, before loading it);
  checkpoint  inside a checkpoint (--checkpoint-every K) after the step: after
              writing it, before the rename that makes it the group's.
A killed group is replaced by spare processes that have imported torch, built the model
and optimizer (and the group's own process group) and wait (hot spares): the same
replica id, new processes, nothing learned in memory. --rejoin-after S holds them back S
seconds, as a replacement machine that takes time to arrive.

Run:
  python ft_train.py --groups 2 --steps 12 --kill-group 1 --at 5 --report ft.json
  python ft_train.py --groups 2 --group-size 2 --steps 12 --kill-group 1 --at 5
  python ft_train.py --chaos 3 --steps 40 --checkpoint-every 4
Across machines, start torchft's lighthouse once (torchft_lighthouse --min_replicas 2
--bind [::]:29510) and on each machine:
  python ft_train.py --groups 2 --local-groups K --lighthouse http://HOST0:29510 --hostname MY_ADDR

Source: torchft 0.2.0 (its Manager, ProcessGroupGloo, ManagedProcessGroup,
DistributedDataParallel, Optimizer and DiLoCo; its tests manager_integ_test.py,
local_sgd_integ_test.py and fsdp_test.py, whose all-reduce hook this FT-HSDP follows);
no single article covers it.
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
WHERE = ("step", "allreduce", "heal", "checkpoint")
# Every rank's process is forked from one server that has imported torch and torchft
# once: a new process (a spare) is ready in a fraction of a second, not after an import.
FORKS = multiprocessing.get_context("forkserver")
DIMS = (10, 10, 5)   # input, hidden, output: chapter 4's ToyModel (--hidden widens it)


def make_model(seed, hidden=DIMS[1]):
    """The model every group starts from (the same on every group: init_sync=False)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIMS[0], hidden), nn.ReLU(),
                         nn.Linear(hidden, DIMS[2])).double()


def batch(seed, step, shard, size=8):
    """The batch of data shard `shard` at step `step`: a function of both, nothing else.
    Rank r of replica group g reads shard g * group_size + r."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + shard)
    x = torch.randn(size, DIMS[0], generator=g, dtype=torch.float64)
    y = torch.randn(size, DIMS[2], generator=g, dtype=torch.float64)
    return x, y


def local(tensor):
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor, else itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def digest(model):
    """sha256 of this rank's parameter bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p).detach().contiguous().numpy().tobytes())
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


def shard_in_group(model, args, store, timeout):
    """FT-HSDP, inside the group: a gloo process group of the group's ranks (a new one for
    each incarnation) and FSDP2 over it, each Linear and the root a unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.PrefixStore(f"group{args.incarnation}", store),
                            rank=args.group_rank, world_size=args.group_size, timeout=timeout)
    mesh = init_device_mesh("cpu", (args.group_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def average_across_groups(manager, model):
    """FT-HSDP, across the groups: FSDP2 calls the hook with this rank's reduce-scattered
    gradient shard, and ManagedProcessGroup sends it to Manager.allreduce, which averages
    it over rank `group_rank` of every group in the quorum (torchft's fsdp_test.py)."""
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    replicas = ManagedProcessGroup(manager)

    def all_reduce_hook(shard):
        dist.all_reduce(shard, group=replicas, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)


def save_checkpoint(args, model, manager, die, step):
    """The group's checkpoint after committing `step`, named by the steps done (step + 1):
    every rank writes its part with torch.distributed.checkpoint into step-N.tmp, then rank
    0 renames it to step-N. A reader finds a complete checkpoint or none, never a torn one,
    and no complete checkpoint is ever replaced."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(args.checkpoint, args.replica_id, f"step-{manager.current_step():06d}")
    dcp.save({"model": model.state_dict(), "torchft": manager.state_dict()},
             checkpoint_id=final + ".tmp")
    die("checkpoint", step)                       # a planned death lands here
    if args.group_rank == 0:
        os.replace(final + ".tmp", final)
    return os.path.abspath(final)


def worker(args):
    """One rank of one replica group: train until the Manager's step reaches --steps."""
    import warnings

    from torchft import Manager, Optimizer, ProcessGroupGloo
    warnings.filterwarnings("ignore", message=".*(find_unused_parameters|not writable|"
                            "assuming the intent is to save in a single process)")

    timeout = timedelta(seconds=args.timeout)
    store = dist.TCPStore(args.hostname, args.store_port, is_master=False,
                          timeout=timedelta(seconds=args.deadline))
    model = make_model(args.seed, args.hidden)
    if args.group_size > 1:
        shard_in_group(model, args, store, timeout)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    me = f"{args.incarnation}.{args.group_rank}"
    if args.incarnation > 0:                         # a spare: all set up, waiting for its turn
        store.set(f"ready{me}", "1")
        store.wait([f"start{args.incarnation}"])
    die_where, _, die_at = (args.die or "none:-1").partition(":")
    die_at = int(die_at)
    records = []
    out = open(args.log, "a", buffering=1)

    def write(row):
        out.write(json.dumps(dict(row, group=args.group, rank=args.group_rank)) + "\n")

    def die(where, step):
        """Exit here if this is the planned death: the first time at WHERE at or after STEP
        with every group in the quorum (so that one is left to heal from)."""
        if where != die_where or step < die_at:
            return
        if where != "heal" and manager.num_participants() < args.groups:
            return
        write({"event": "killed", "where": where, "incarnation": args.incarnation,
               "step": step, "time": time.time()})
        out.flush()
        os._exit(KILLED)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        if die_where == "heal":
            die("heal", die_at)
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        records.append({"event": "healed", "step": manager.current_step(), "time": time.time(),
                        "weights": digest(model)})

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict,
        use_async_quorum=False, init_sync=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        replica_id=args.replica_id, store_addr=args.hostname, store_port=args.store_port,
        rank=args.group_rank, world_size=args.group_size, lighthouse_addr=args.lighthouse,
        hostname=args.hostname)
    if args.incarnation == 0:                        # the first start: every group together
        store.set(f"ready{me}", "1")
        store.wait(["go"])

    sent = count_bytes(manager)
    if args.diloco:
        return train_diloco(args, manager, model, inner, out, sent)
    if args.group_size > 1:
        average_across_groups(manager, model)
        forward = model
    else:
        forward = tolerant_ddp(manager, model, args.torchft_hook)
    optimizer = Optimizer(manager, inner)
    if die_where == "allreduce":
        start_allreduce = manager.allreduce

        def die_in_allreduce(tensor, *a, **kw):   # the peers are already inside theirs
            die("allreduce", manager.current_step())
            return start_allreduce(tensor, *a, **kw)
        manager.allreduce = die_in_allreduce

    try:
        while manager.current_step() < args.steps:
            optimizer.zero_grad()                    # waits for the quorum (and heals)
            step = manager.current_step()
            for r in records:
                write(r)
            records.clear()
            if step >= args.steps:                   # healed to the end: nothing left to do
                break
            write({"event": "contributed", "step": step, "quorum": manager._quorum_id})
            x, y = batch(args.seed, step, args.group * args.group_size + args.group_rank)
            loss = ((forward(x) - y) ** 2).mean()
            loss.backward()                          # the all-reduces run in here
            die("step", step)
            optimizer.step()                         # commits only if every rank agrees
            committed = manager.current_step() == step + 1
            row = {"event": "step", "incarnation": args.incarnation, "step": step,
                   "quorum": manager._quorum_id, "participants": manager.num_participants(),
                   "committed": committed, "loss": loss.item(), "bytes": sent[0],
                   "calls": sent[1], "weights": digest(model), "time": time.time()}
            write(row)
            if committed and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                path = save_checkpoint(args, model, manager, die, step)
                if args.group_rank == 0:
                    write({"event": "checkpoint", "step": step + 1, "path": path,
                           "time": time.time()})
            time.sleep(args.step_seconds)            # stands in for a longer step
            if args.group_rank == 0:
                print(f"group {args.group} step {step:3d} quorum {row['quorum']} "
                      f"participants {row['participants']} committed {committed}", flush=True)
        write_final(write, manager, model)
        if args.chaos or args.kill_group is not None:   # a spare may still be on its way
            stay_until_all_finish(args, manager, store)
    finally:
        out.close()
        manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def write_final(write, manager, model):
    """The full parameters (FSDP2 gathers them inside the group) when the last step is done."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    write({"event": "final", "step": manager.current_step(), "weights": digest(model),
           "params": [p.detach().flatten().tolist() for p in full]})


def stay_until_all_finish(args, manager, store):
    """A group that has finished keeps joining quorums, taking no step, until the driver says
    every group has finished: a group that rejoins late still finds a peer to heal from. The
    ranks of a group leave together (a rank that left would stall its partner's quorum)."""
    store.set(f"finished{args.incarnation}.{args.group_rank}", "1")
    while True:
        leave = torch.tensor([float(store.check(["finish"]))])
        if args.group_size > 1:
            dist.all_reduce(leave, op=dist.ReduceOp.MIN)
        if leave.item():
            return
        manager.start_quorum()


def count_bytes(manager):
    """Count the bytes this rank hands to the Manager's all-reduce (DDP's buckets, FSDP2's
    gradient shards, DiLoCo's pseudo-gradients: every cross-group byte goes through
    Manager.allreduce), and the calls."""
    sent = [0, 0]
    start_allreduce = manager.allreduce

    def counted(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        sent[1] += 1
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
                out.write(json.dumps({"event": "inner", "group": args.group, "rank": 0,
                                      "inner": inner_step, "step": manager.current_step(),
                                      "loss": loss.item(), "bytes": sent[0], "calls": sent[1],
                                      "time": time.time()}) + "\n")
                inner_step += 1
        write_final(lambda row: out.write(json.dumps(dict(row, group=args.group, rank=0)) + "\n"),
                    manager, model)
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
    if args.group_size not in (1, 2):
        parser.error("--group-size is 1 (DDP) or 2 (FSDP2 over the group's two ranks)")
    if args.steps < 1 or args.hidden < 1:
        parser.error("--steps and --hidden must be at least 1")
    try:
        local_groups = sorted({int(g) for g in args.local_groups.split(",")}) \
            if args.local_groups else list(range(args.groups))
    except ValueError:
        parser.error(f"--local-groups {args.local_groups!r} is not a list of group numbers")
    if not local_groups or not set(local_groups) <= set(range(args.groups)):
        parser.error(f"--local-groups {args.local_groups} are not groups (0..{args.groups - 1})")
    if len(local_groups) < args.groups and not args.lighthouse:
        parser.error("--local-groups needs --lighthouse: the other groups must find it too")
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
    if (args.chaos or args.kill_group is not None) and len(local_groups) < args.groups:
        parser.error("failures are injected only when every group runs here (no --local-groups)")
    if args.rejoin_after < 0:
        parser.error("--rejoin-after must be 0 or more seconds")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be 0 (none) or a number of steps")
    if args.where == "checkpoint" and args.kill_group is not None and not args.checkpoint_every:
        parser.error("--where checkpoint needs --checkpoint-every")
    if args.diloco < 0:
        parser.error("--diloco must be 0 (DDP) or a number of inner steps")
    if args.diloco and (args.chaos or args.kill_group is not None or args.checkpoint_every):
        parser.error("--diloco runs without injected failures or checkpoints")
    if args.diloco and args.group_size > 1:
        parser.error("--diloco runs with --group-size 1")
    if args.torchft_hook and args.group_size > 1:
        parser.error("--torchft-hook is DDP's (--group-size 1)")
    if args.lighthouse and not lighthouse_reachable(args.lighthouse):
        parser.error(f"lighthouse {args.lighthouse} cannot be reached")
    for option, path in (("--report", args.report), ("--checkpoint", args.checkpoint)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{option} {path}: no such directory")
    if args.checkpoint and os.path.exists(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint} exists: name a new folder")
    return ids, local_groups


def plan_kills(args):
    """The kills as [group, step, where]: --kill-group/--at, or --chaos N drawn from --seed.

    Chaos kills come at least --chaos-gap steps apart, so that a killed group has
    rejoined before the next kill, and never in the last --chaos-gap steps; kills inside
    a checkpoint only when there are checkpoints."""
    if args.kill_group is not None:
        return [[args.kill_group, args.at, args.where]]
    where = WHERE if args.checkpoint_every else WHERE[:3]
    rng = random.Random(args.seed)
    kills, step = [], 0
    for _ in range(args.chaos):
        step += rng.randint(args.chaos_gap, 2 * args.chaos_gap)
        if step >= args.steps - args.chaos_gap:
            break
        kills.append([rng.randrange(args.groups), step, rng.choice(where)])
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
    """Start one replica group's ranks, forked from a server that has imported torchft.

    Incarnation 0 is the group's first start; incarnation k > 0 is a spare that waits
    until the driver sets start<k> in the group's store."""
    ranks = []
    for rank in range(args.group_size):
        work = argparse.Namespace(**vars(args))
        work.__dict__.update(group=group, group_rank=rank, replica_id=replica_id,
                             store_port=store_port, lighthouse=lighthouse,
                             incarnation=incarnation, log=log, die=die)
        process = FORKS.Process(target=worker, args=(work,),
                                name=f"{replica_id}.{incarnation}.{rank}")
        process.start()
        ranks.append(process)
    return ranks


def drive(args, ids, local_groups):
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
    stores = {g: dist.TCPStore(args.hostname, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=args.timeout)) for g in local_groups}
    procs, spares, exits, rows, dying, rejoin = {}, {}, {}, [], {}, {}
    plans = {g: deaths(kills, g) for g in local_groups}

    def start(g, k):
        die = plans[g][k] if k < len(plans[g]) else None
        return start_group(args, g, ids[g], stores[g].port, address, k, logs[g], die)

    def stop_all():
        for p in [p for ranks in procs.values() for p in ranks] + \
                 [p for ks in spares.values() for ranks in ks for p in ranks]:
            if p.exitcode is None:
                p.kill()
            p.join()

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stack.callback(stop_all)
        logs = {g: os.path.join(tmp, f"group{g}.jsonl") for g in local_groups}
        incarnation = dict.fromkeys(local_groups, 0)
        for g in local_groups:                        # spares for every planned death
            procs[g] = start(g, 0)
            spares[g] = [start(g, k) for k in range(1, len(plans[g]) + 2)]
        for g in local_groups:                        # every Manager up, every spare imported
            stores[g].wait([f"ready{k}.{r}" for k in range(len(plans[g]) + 2)
                            for r in range(args.group_size)],
                           timedelta(seconds=max(1.0, deadline - time.monotonic())))
        for g in local_groups:
            stores[g].set("go", "1")
        t0 = time.time()
        while procs:
            if time.monotonic() > deadline:
                raise SystemExit(f"ft_train: not done after {args.deadline} s; stopped")
            if all(stores[g].check([f"finished{incarnation[g]}.{r}" for r in range(args.group_size)])
                   for g in procs):
                for store in stores.values():     # every group has finished: all may leave
                    store.set("finish", "1")
            for g, ranks in list(procs.items()):
                codes = [p.exitcode for p in ranks]
                if all(c is None for c in codes):
                    continue
                if KILLED not in codes:
                    if None in codes and all(c in (None, 0) for c in codes):
                        continue                      # finishing, one rank after the other
                    for p in ranks:                   # done, or a rank failed: the group ends
                        if p.exitcode is None:
                            p.kill()
                        p.join()
                    exits[g] = max((p.exitcode for p in ranks), key=abs)
                    del procs[g]
                    continue
                # A rank was killed: the whole group goes, as torchelastic restarts a whole
                # group. Its other ranks die at the same point; wait for them, bounded.
                if None in codes and time.monotonic() < dying.setdefault(
                        g, time.monotonic() + args.timeout):
                    continue
                for p in ranks:
                    if p.exitcode is None:
                        p.kill()
                    p.join()
                dying.pop(g, None)
                incarnation[g] += 1                   # the spares take over, --rejoin-after
                procs[g] = spares[g].pop(0) if spares[g] else start(g, incarnation[g])
                rejoin[g] = time.monotonic() + args.rejoin_after
            for g, when in list(rejoin.items()):
                if time.monotonic() >= when:
                    del rejoin[g]
                    print(f"group {g} killed; spare {incarnation[g]} takes over", flush=True)
                    for key in ("manager_addr", "replica_id"):   # the dead rank 0's, in the store
                        stores[g].delete_key(key)
                    stores[g].set(f"start{incarnation[g]}", "1")
            time.sleep(0.05)
        stop_all()
        for g in local_groups:
            with open(logs[g]) as f:
                rows += [json.loads(line) for line in f]
    if lighthouse is not None:
        lighthouse.shutdown()
    report = {"groups": len(ids), "group_size": args.group_size, "replica_ids": ids,
              "local_groups": local_groups, "steps": args.steps, "seed": args.seed,
              "lr": args.lr, "hidden": args.hidden, "planned_kills": kills, "start": t0,
              "exit_codes": exits,
              "checkpoint_folder": args.checkpoint and os.path.abspath(args.checkpoint),
              "checkpoint_every": args.checkpoint_every}
    for event in ("step", "inner", "contributed", "killed", "healed", "checkpoint", "final"):
        report[event] = [r for r in rows if r["event"] == event]
    if args.report:
        with open(args.report + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(args.report + ".tmp", args.report)
    bad = {g: rc for g, rc in exits.items() if rc != 0}
    if bad:
        raise SystemExit(f"ft_train: groups exited with {bad}")
    print(f"done: {len({r['group'] for r in report['final']})} groups at step {args.steps}, "
          f"{len({(k['group'], k['incarnation']) for k in report['killed']})} kills, "
          f"{len({(h['group'], h['step']) for h in report['healed']})} heals, "
          f"final weights {sorted({r['weights'] for r in report['final']})}")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--group-size", type=int, default=1,
                        help="ranks per group: 1 (DDP, default) or 2 (FSDP2 inside: FT-HSDP)")
    parser.add_argument("--steps", type=int, default=12, help="steps to commit (default 12)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=DIMS[1],
                        help=f"the model's hidden width (default {DIMS[1]})")
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="sleep this long in every step (default 0.1)")
    parser.add_argument("--kill-group", type=int, help="the group to kill")
    parser.add_argument("--at", type=int, help="the step at which it dies")
    parser.add_argument("--where", choices=WHERE, default="step")
    parser.add_argument("--checkpoint", default="checkpoints",
                        help="folder of the groups' checkpoints (default ./checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="a checkpoint every K committed steps (default 0: none)")
    parser.add_argument("--diloco", type=int, default=0, metavar="H",
                        help="DiLoCo with H inner steps per sync instead of DDP (default 0: DDP)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD lr")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="DiLoCo's outer SGD momentum (default 0)")
    parser.add_argument("--rejoin-after", type=float, default=0.0, metavar="SECONDS",
                        help="a killed group's spares start this long after it died (default 0)")
    parser.add_argument("--chaos", type=int, default=0,
                        help="instead: N kills of random groups, steps and places (from --seed)")
    parser.add_argument("--chaos-gap", type=int, default=10,
                        help="steps between chaos kills, at least (default 10)")
    parser.add_argument("--replica-ids", help="comma-separated (default group0,group1,...)")
    parser.add_argument("--lighthouse", help="use a running lighthouse (http://host:port)")
    parser.add_argument("--local-groups",
                        help="start only these groups here (comma-separated; default all)")
    parser.add_argument("--hostname", default="127.0.0.1",
                        help="the address other groups reach this machine's groups at")
    parser.add_argument("--timeout", type=int, default=10,
                        help="seconds for every collective, quorum and heal (default 10)")
    parser.add_argument("--deadline", type=float, default=120,
                        help="seconds the whole run may take (default 120)")
    parser.add_argument("--report", help="write every step of every rank here (JSON)")
    parser.add_argument("--torchft-hook", action="store_true",
                        help="use torchft's own DDP comm hook (fails when a peer dies)")
    args = parser.parse_args(argv)
    if not args.checkpoint_every:
        args.checkpoint = None
    ids, local_groups = check(args, parser)
    # torch.optim's first optimizer (and fully_shard) import torch._dynamo: seconds, paid
    # once here rather than in every process
    preload = ["torch", "torch._dynamo", "torchft"]
    if args.group_size > 1:
        preload.append("torch.distributed.fsdp")
    if args.checkpoint_every:
        preload.append("torch.distributed.checkpoint")
    FORKS.set_forkserver_preload(preload)
    drive(args, ids, local_groups)


if __name__ == "__main__":
    main()
