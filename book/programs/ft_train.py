r"""Per-step fault tolerance with torchft: one replica group of a job that survives failures.

Chapter 4 recovers the torchrun way: one worker dies, every worker stops, and the new
group reloads the last checkpoint. Here the job is split into replica groups that train
the same model on different data. torchft's lighthouse (a server of its own) forms a
quorum of the live groups before every step; the gradients are averaged over the groups
in the quorum only; and a step is applied (committed) only when every rank of a group
says its all-reduces went well. A group that dies is dropped from the next quorum and the
others go on. When it is started again it joins a quorum, finds that it is behind, and
copies the model and optimizer from a live peer (the "heal") before it takes part.

This program is one replica group: start it with torchrun once per group, after the
lighthouse. torchrun restarts a group whose rank dies (--max-restarts). Run:
  torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 1000 \
      --heartbeat_timeout_ms 1000
  REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
      torchrun --standalone --nproc-per-node 1 --max-restarts 5 ft_train.py --rows rows
  REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \
      torchrun --standalone --nproc-per-node 1 --max-restarts 5 ft_train.py --rows rows
(each torchrun on a port of its own: --rdzv-endpoint localhost:PORT). The group's size is
torchrun's --nproc-per-node: 1 runs torchft's DistributedDataParallel; 2 shards the model
over the group's two ranks with FSDP2 (fully_shard), whose all-reduce hook averages each
rank's gradient shard over the same rank of the other groups through the Manager: FT-HSDP.
--diloco H runs torchft's DiLoCo instead (H local steps, then one outer step). The model
and the data are float64, generated from --seed. --plain-ddp runs torch's own DDP over
torchrun's ranks without torchft, the same model and batches, to compare a step's cost.
--state-mb N gives each rank N MB more float64 state that every heal moves with the model
(this toy model weighs under 2 KB; a large model's weights and optimizer moments weigh GBs):
filled from --seed at the first start, never trained, left unfilled by a restarted rank,
whose heal fills it.

Every rank appends one JSON line per event to ROWS/group<G>.rank<R>.jsonl (opened in
append mode: a restarted rank continues its file), each with the group, the rank, the
incarnation (torchrun's TORCHELASTIC_RESTART_COUNT) and the time:
  contributed  before the backward: step, participants (its batch may be in that step);
  step         after optimizer.step: step, participants, committed, loss, weights digest;
  healed       after loading a peer's state: step, weights digest (and the --state-mb
               state's; the row's time is taken before the digests);
  checkpoint   a complete checkpoint of the group (--checkpoint-every K);
  inner, sync  (--diloco) after each inner step: its number, the syncs done, the loss; after
               each try at a sync: its number, committed, participants, weights digest;
  final        the last step's full parameters.
A group that has done the last step keeps joining quorums until the same quorum of every
group has formed twice in a row, so that a group that comes back late finds a peer to heal
from, still there while it heals. A restarted group takes no step before it has healed to
the step its earlier incarnations saw committed (its own rows say which), nor alone at step
0: one that finds no peer to heal from within --linger seconds exits with status 1 rather
than train again the steps the job has done.

Source: torchft 0.2.0 (its Manager, ProcessGroupGloo, ManagedProcessGroup,
DistributedDataParallel, Optimizer and DiLoCo; its train_ddp.py, which runs the same way,
and fsdp_test.py, whose all-reduce hook this FT-HSDP follows).
"""

import argparse
import hashlib
import json
import os
import socket
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "error")   # the Manager logs every quorum
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

DIMS = (10, 10, 5)   # input, hidden, output: chapter 4's ToyModel (--hidden widens it)


def make_model(seed, hidden=DIMS[1]):
    """The model every group starts from (the same on every group: init_sync=False)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIMS[0], hidden), nn.ReLU(),
                         nn.Linear(hidden, DIMS[2])).double()


def make_state(seed, megabytes, incarnation):
    """--state-mb's state: megabytes MB of float64, from the seed at the first start; a
    restarted rank's is left unfilled (its heal copies the donor's into it). None for 0."""
    if not megabytes:
        return None
    count = megabytes * 2**20 // 8
    if incarnation:
        return torch.empty(count, dtype=torch.float64)
    return torch.randn(count, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


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
    return digest_of(model.parameters())


def digest_of(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(local(t).detach().contiguous().numpy()).cast("B"))
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


class QuorumLog:
    """What torchft logs on its "torchft_quorums" logger each time the quorum changes (a new
    quorum id), just before the Manager reconfigures its process group: the quorum's step
    (the step every member gets with it, the one the healers heal to) and how many changes."""

    def __init__(self):
        import logging

        class Seen(logging.Handler):
            def emit(handler, record):
                self.step = getattr(record, "step", self.step)
                self.changes += 1

        self.step, self.changes = 0, 0
        quorums = logging.getLogger("torchft_quorums")
        quorums.setLevel(logging.INFO)
        quorums.propagate = False
        quorums.addHandler(Seen())


def quorum_named_gloo(timeout, seen):
    """torchft's ProcessGroupGloo, meeting under a name no earlier quorum has used.

    The Manager builds each quorum's gloo group in the store of the quorum's first group
    (torchrun's agent's store, which lives as long as that group's torchrun) under the prefix
    torchft/<quorum id>/<group rank>. The lighthouse numbers its quorums from 1, and a
    lighthouse that is started again numbers them from 1 again: its quorum 1 meets under the
    prefix the old lighthouse's quorum 1 used, where that quorum's addresses are still
    stored. A rank that reads a peer's key before the peer has written it again gets the old
    address and fails to connect; the step fails, the next quorum gets the next number, which
    the old lighthouse used too, and so on until the numbers pass the old ones. Here the name
    holds the quorum's step too (``seen``, a QuorumLog): steps only grow, so a quorum of a
    later lighthouse never meets under an earlier one's name unless no step was committed in
    between."""
    from torchft import ProcessGroupGloo

    class QuorumNamedGloo(ProcessGroupGloo):
        def configure(self, store_addr, *args, **kwargs):
            super().configure(f"{store_addr}/step{seen.step}", *args, **kwargs)

    return QuorumNamedGloo(timeout=timeout)


def shard_in_group(model):
    """FT-HSDP, inside the group: FSDP2 over the group's ranks, each Linear and the root a unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def average_across_groups(manager, model):
    """FT-HSDP, across the groups: FSDP2 calls the hook with this rank's reduce-scattered
    gradient shard, and ManagedProcessGroup sends it to Manager.allreduce, which averages
    it over the same rank of every group in the quorum (torchft's fsdp_test.py)."""
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    replicas = ManagedProcessGroup(manager)

    def all_reduce_hook(shard):
        dist.all_reduce(shard, group=replicas, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)


def count_bytes(manager):
    """Count the bytes this rank hands to Manager.allreduce (DDP's buckets, FSDP2's gradient
    shards, DiLoCo's pseudo-gradients: every cross-group byte goes through it), and the calls."""
    sent = [0, 0]
    start_allreduce = manager.allreduce

    def counted(tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        sent[1] += 1
        return start_allreduce(tensor, *a, **kw)
    manager.allreduce = counted
    return sent


def save_checkpoint(args, model, manager):
    """The group's checkpoint, named by the steps done: every rank writes its part with
    torch.distributed.checkpoint into step-N.tmpK (K: the incarnation), then rank 0 renames it
    to a name nobody has used. A reader finds a complete checkpoint or none, never a torn one."""
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(args.checkpoint, f"group{args.group}")
    name = f"step-{manager.current_step():06d}"
    incarnation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    written = os.path.join(folder, f"{name}.tmp{incarnation}")   # this incarnation's own
    final = new_name(folder, name, incarnation)   # on every rank, before rank 0 renames
    dcp.save({"model": model.state_dict(), "torchft": manager.state_dict()},
             checkpoint_id=written)
    if dist.is_initialized():
        dist.barrier()
    if args.rank == 0:
        os.rename(written, final)
    return os.path.abspath(final)


def new_name(folder, name, incarnation):
    """step-N, or step-N.K (K the incarnation) when step-N exists: a complete checkpoint is
    never replaced."""
    final = os.path.join(folder, name)
    return final if not os.path.exists(final) else f"{final}.{incarnation}"


def join_the_group(timeout):
    """The group's own process group, on torchrun's store. torchrun's agent serves that store
    and keeps it, keys and all, across the restarts of the group (torch 2.14 no longer prefixes
    the keys with the restart count). A new incarnation whose rank reads a key its peer has not
    yet written again would get the dead incarnation's address and time out connecting to it:
    each incarnation meets under a prefix of its own. Then rank 0 deletes the last
    incarnation's keys of torchft's Manager (which finds rank 0's server under a fixed key in
    the same store) before any rank builds its Manager."""
    incarnation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=rank == 0 and not agent_serves, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"incarnation{incarnation}", store),
                            rank=rank, world_size=size, timeout=timeout)
    if rank == 0:
        for key in ("manager_addr", "replica_id"):
            store.delete_key(key)
    dist.barrier()


def train(args):
    """One rank of one replica group: train until the Manager's step reaches --steps."""
    import warnings

    from torchft import Manager
    warnings.filterwarnings("ignore", message=".*(find_unused_parameters|not writable|"
                            "assuming the intent is to save in a single process)")
    timeout = timedelta(seconds=args.timeout)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:                                     # the group's own ranks, torchrun's store
        join_the_group(timeout)
    model = make_model(args.seed, args.hidden)
    if size > 1:
        shard_in_group(model)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    os.makedirs(args.rows, exist_ok=True)
    mine = os.path.join(args.rows, f"group{args.group}.rank{args.rank}.jsonl")
    known = reached(mine)                          # what earlier incarnations saw committed
    out = open(mine, "a", buffering=1)
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def write(event, **row):
        out.write(json.dumps({"event": event, "group": args.group, "rank": args.rank,
                              "incarnation": incarnation, "time": time.time(), **row}) + "\n")

    extra = make_state(args.seed, args.state_mb, incarnation)

    def state_dict():
        held = {"model": model.state_dict(), "optim": inner.state_dict()}
        return held if extra is None else {**held, "state": extra}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        if extra is not None:
            extra.copy_(sd["state"])
        healed_at = time.time()
        more = {} if extra is None else {"state": digest_of([extra])}
        write("healed", step=manager.current_step(), weights=digest(model), time=healed_at,
              **more)

    seen = QuorumLog()
    manager = Manager(
        pg=quorum_named_gloo(timeout, seen), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict,
        use_async_quorum=False, init_sync=False, replica_id=f"group{args.group}",
        timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timeout,
        quorum_retries=args.quorum_retries, lighthouse_addr=args.lighthouse)
    write("started", step=manager.current_step(), pid=os.getpid())
    sent = count_bytes(manager)
    try:
        if args.diloco:
            train_diloco(args, manager, model, inner, write, sent)
        else:
            train_ddp(args, manager, model, inner, write, size, sent, known)
        stay_until_every_group_is_back(args, manager, seen)
    finally:
        out.close()
        manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def train_ddp(args, manager, model, inner, write, size, sent, known):
    """torchft's DDP (a group of one) or FSDP2 in the group (two): one quorum per step."""
    from torchft import Optimizer

    if size > 1:
        average_across_groups(manager, model)
        forward = model
    else:
        forward = tolerant_ddp(manager, model, args.torchft_hook)
    optimizer = Optimizer(manager, inner)
    while manager.current_step() < last_step(args):
        optimizer.zero_grad()                    # waits for the quorum (and heals)
        wait_for_a_peer(args, manager, known)    # a restarted group: healed first
        step = manager.current_step()
        if step >= last_step(args):              # healed to the end: nothing left to do
            break
        write("contributed", step=step, participants=manager.num_participants())
        x, y = batch(args.seed, step, args.group * size + args.rank)
        loss = ((forward(x) - y) ** 2).mean()
        loss.backward()                          # the all-reduces run in here
        optimizer.step()                         # commits only if every rank agrees
        committed = manager.current_step() == step + 1
        write("step", step=step, participants=manager.num_participants(), committed=committed,
              loss=loss.item(), weights=digest(model), bytes=sent[0], calls=sent[1])
        if committed and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            path = save_checkpoint(args, model, manager)
            if args.rank == 0:
                write("checkpoint", step=step + 1, path=path)
        time.sleep(args.step_seconds)            # stands in for a longer step
    write_final(write, manager, model)


def train_diloco(args, manager, model, inner, write, sent):
    """DiLoCo (torchft.local_sgd.DiLoCo): --diloco H inner steps on the group's own data, then
    one all-reduce of the pseudo-gradient (parameters at the last sync minus now) and one outer
    SGD step (--outer-lr, --outer-momentum, Nesterov when --nesterov). The Manager's step
    counts the syncs. Inner step k after sync s reads the batch s * H + k, so a group that
    healed to sync s goes on with the data that follows it. After each try at a sync, a
    "sync" row: the sync's number, committed or not, the participants, the weights (a sync
    that fails leaves them at the last sync's: DiLoCo restores them)."""
    from torchft.local_sgd import DiLoCo

    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.nesterov)
    inner_step, k, window = 0, 0, manager.current_step()
    with DiLoCo(manager, [model], inner, outer, sync_every=args.diloco,
                backup_device=torch.device("cpu"), pin_memory=False):
        while manager.current_step() < last_step(args):
            x, y = batch(args.seed, window * args.diloco + k, args.group)
            inner.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            inner.step()                         # every H-th: the sync and the outer step
            write("inner", inner=inner_step, step=manager.current_step(), loss=loss.item(),
                  bytes=sent[0], calls=sent[1])
            inner_step, k = inner_step + 1, k + 1
            if k == args.diloco:                 # that inner.step() tried the sync
                done = manager.current_step() > window   # (a heal in its quorum: further)
                write("sync", step=manager.current_step() - 1 if done else window,
                      committed=done, participants=manager.num_participants(),
                      weights=digest(model))
                k, window = 0, manager.current_step()
            time.sleep(args.step_seconds)        # stands in for a longer step
    write_final(write, manager, model)


def train_plain_ddp(args):
    """torch's own DistributedDataParallel over torchrun's ranks, no torchft: the same model,
    batch, gloo and rows (rank r is "group" r), for what torchft's step costs over DDP's."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model(args.seed, args.hidden)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    os.makedirs(args.rows, exist_ok=True)
    try:
        with open(os.path.join(args.rows, f"group{rank}.rank0.jsonl"), "a", buffering=1) as out:
            for step in range(args.steps):
                optimizer.zero_grad()
                x, y = batch(args.seed, step, rank)
                loss = ((ddp(x) - y) ** 2).mean()
                loss.backward()                      # gloo's all-reduce of each bucket
                optimizer.step()
                out.write(json.dumps({"event": "step", "group": rank, "rank": 0,
                                      "incarnation": 0, "time": time.time(), "step": step,
                                      "participants": size, "committed": True,
                                      "loss": loss.item(), "weights": digest(model)}) + "\n")
                time.sleep(args.step_seconds)
    finally:
        dist.destroy_process_group()


def last_step(args):
    """--steps, or the step written in --stop-file once it exists (the smaller): a way to end
    the run early from outside. Every group reads it before each step, so all end at the same
    step when it is written (whole: a temporary file, then a rename) at least two steps past
    the furthest group."""
    try:
        with open(args.stop_file) as f:
            return min(args.steps, int(f.read()))
    except (OSError, TypeError, ValueError):
        return args.steps


def write_final(write, manager, model):
    """The full parameters (FSDP2 gathers them inside the group) when the last step is done."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    write("final", step=manager.current_step(), weights=digest(model),
          params=[p.detach().flatten().tolist() for p in full])


def reached(path):
    """The step the job had reached by this rank's earlier incarnations, from its own rows
    (the file it appends to): past its last committed step, or the step it last healed to."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    step = 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:            # the last line, cut short by a kill
            continue
        if row.get("event") == "step" and row.get("committed"):
            step = max(step, row["step"] + 1)
        elif row.get("event") == "healed":
            step = max(step, row["step"])
    return step


def wait_for_a_peer(args, manager, known):
    """A restarted group must heal from a live peer before it trains: at step 0 it would
    train the steps the others committed a second time. Not only alone: two groups restarted
    together (a group killed while it served the other its heal) can form a quorum of their
    own, both at step 0, while the group that holds the state is still in its failed step,
    and nobody in it heals. So it takes no step below ``known`` (the step its earlier
    incarnations saw the job reach, ``reached``) and, restarted at step 0, none alone. It
    joins quorums for up to --linger seconds until one heals it (the heal happens in
    start_quorum), then refuses: exit status 1."""
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if incarnation == 0 or args.groups < 2:
        return

    def behind():
        return manager.current_step() < known or (
            manager.num_participants() < 2 and manager.current_step() == 0)

    until = time.monotonic() + args.linger
    while behind():
        if time.monotonic() >= until:
            raise SystemExit(f"ft_train: group {args.group}, restarted (incarnation "
                             f"{incarnation}), found no live peer to heal from in "
                             f"{args.linger:g} s: it will not train from step "
                             f"{manager.current_step()} {'alone' if known == 0 else 'again'}")
        time.sleep(args.step_seconds)
        manager.start_quorum()


def stay_until_every_group_is_back(args, manager, seen):
    """Keep joining quorums, taking no step, until two quorums in a row hold every group and
    the second is the same quorum as the first (torchft logged no change between them), or
    --linger seconds pass: a group restarted near the end still finds a peer to heal from.
    A group that heals in a quorum fetches the state from its donor's ranks after the quorum
    returns, and asks for the next quorum only once it has healed; torchft's Manager server
    forms a group's quorum only when each of its ranks has asked. So the next quorum of the
    same members means that every heal of the last one is done; a quorum of every group that
    is not the same one (a group started again in between, with a new Manager) may hold a
    group that heals in it, and must be followed by one more. The quorum this group last
    trained in counts. Every rank of a group sees the same quorums: they leave together."""
    until = time.monotonic() + args.linger
    full, changes = manager.num_participants() == args.groups, seen.changes
    while time.monotonic() < until:
        time.sleep(args.step_seconds)
        manager.start_quorum()
        was_full, full = full, manager.num_participants() == args.groups
        if was_full and full and seen.changes == changes:
            return
        changes = seen.changes


def lighthouse_reachable(addr, seconds=2.0):
    """True when something accepts a TCP connection at addr (http://host:port)."""
    host, _, port = addr.split("//", 1)[-1].rstrip("/").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
            return True
    except (OSError, ValueError):
        return False


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr and exit status 2, without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def from_env(name, default=None):
    value = os.environ.get(name)
    return default if value in (None, "") else value


def check(args, parser):
    """Every option checked before anything starts: one line, exit 2."""
    if args.plain_ddp:
        if args.steps < 1 or args.hidden < 1:
            parser.error("--steps and --hidden must be at least 1")
        if args.diloco or args.checkpoint_every:
            parser.error("--plain-ddp runs plain DDP steps: no --diloco, no --checkpoint-every")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.rows))):
            parser.error(f"--rows {args.rows}: no such directory")
        return
    for option, value in (("--group", args.group), ("--groups", args.groups)):
        try:
            int(value)
        except (TypeError, ValueError):
            parser.error(f"{option} {value!r} is not a number (or set REPLICA_GROUP_ID "
                         "and NUM_REPLICA_GROUPS)")
    args.group, args.groups = int(args.group), int(args.groups)
    if args.groups < 1 or not 0 <= args.group < args.groups:
        parser.error(f"--group {args.group} is not a group of --groups {args.groups}")
    if args.steps < 1 or args.hidden < 1:
        parser.error("--steps and --hidden must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) not in (1, 2):
        parser.error("a group has 1 rank (DDP) or 2 (FSDP2 over them): torchrun "
                     "--nproc-per-node 1 or 2")
    if args.checkpoint_every < 0 or args.diloco < 0 or args.linger < 0 or args.state_mb < 0:
        parser.error("--checkpoint-every, --diloco, --linger and --state-mb must be 0 or more")
    if args.diloco and (args.checkpoint_every or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        parser.error("--diloco runs with one rank a group and no checkpoints")
    if args.torchft_hook and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--torchft-hook is DDP's (one rank a group)")
    if not args.lighthouse:
        parser.error("no lighthouse: give --lighthouse or set TORCHFT_LIGHTHOUSE")
    if not lighthouse_reachable(args.lighthouse):
        parser.error(f"lighthouse {args.lighthouse} cannot be reached")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.rows))):
        parser.error(f"--rows {args.rows}: no such directory")
    if args.checkpoint_every and not os.path.isdir(os.path.dirname(os.path.abspath(args.checkpoint))):
        parser.error(f"--checkpoint {args.checkpoint}: no such directory")


def main(argv=None):
    parser = Parser(prog=os.path.basename(__file__), description=__doc__.splitlines()[0])
    parser.add_argument("--group", default=from_env("REPLICA_GROUP_ID"),
                        help="this replica group's number (default: $REPLICA_GROUP_ID)")
    parser.add_argument("--groups", default=from_env("NUM_REPLICA_GROUPS"),
                        help="how many replica groups (default: $NUM_REPLICA_GROUPS)")
    parser.add_argument("--lighthouse", default=from_env("TORCHFT_LIGHTHOUSE"),
                        help="http://host:port (default: $TORCHFT_LIGHTHOUSE)")
    parser.add_argument("--rows", default=from_env("FT_ROWS", "rows"),
                        help="folder of the per-rank JSON lines (default: $FT_ROWS or ./rows)")
    parser.add_argument("--steps", type=int, default=12, help="steps to commit (default 12)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=DIMS[1],
                        help=f"the model's hidden width (default {DIMS[1]})")
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="sleep this long in every step (default 0.1)")
    parser.add_argument("--state-mb", type=int, default=0, metavar="N",
                        help="N MB more float64 state per rank that a heal moves (default 0)")
    parser.add_argument("--checkpoint", default="checkpoints",
                        help="folder of the groups' checkpoints (default ./checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                        help="a checkpoint every K committed steps (default 0: none)")
    parser.add_argument("--diloco", type=int, default=0, metavar="H",
                        help="DiLoCo with H inner steps per sync instead of DDP (default 0: DDP)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD lr")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="DiLoCo's outer SGD momentum (default 0)")
    parser.add_argument("--nesterov", action="store_true", help="DiLoCo's outer SGD: Nesterov")
    parser.add_argument("--timeout", type=int, default=10,
                        help="seconds for every collective and heal (default 10)")
    parser.add_argument("--quorum-timeout", type=int, default=20,
                        help="seconds a quorum may take (a lighthouse restarting; default 20)")
    parser.add_argument("--quorum-retries", type=int, default=3,
                        help="quorum requests tried again (a lighthouse restarting; default 3)")
    parser.add_argument("--linger", type=float, default=60.0,
                        help="seconds to wait at the end for every group to be back, and for "
                        "a live peer when restarted (default 60)")
    parser.add_argument("--stop-file", default=None, metavar="FILE",
                        help="once FILE exists, the run ends at the step (DiLoCo: sync) it holds")
    parser.add_argument("--torchft-hook", action="store_true",
                        help="use torchft's own DDP comm hook (fails when a peer dies)")
    parser.add_argument("--plain-ddp", action="store_true",
                        help="torch's DDP over torchrun's ranks, no torchft (for comparison)")
    args = parser.parse_args(argv)
    check(args, parser)
    args.rank = int(os.environ.get("RANK", "0"))
    if args.plain_ddp:
        train_plain_ddp(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
