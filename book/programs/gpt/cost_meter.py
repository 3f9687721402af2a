"""Counting what one step of train.py costs, while it runs: the bytes given to every
collective, the tensors autograd keeps for the backward pass, the memory and the time.
torch only; train.py --cost uses it to check the formulas of cost_model.py. This is
measuring machinery: a reader may skip it.

The counter is a TorchDispatchMode (the mechanism of torch's CommDebugMode): every c10d
and functional collective passes through the dispatcher, including DDP's bucket
all-reduces (ProcessGroup::allreduce dispatches c10d::allreduce_) and pipelining's
send/recv (ProcessGroup::send dispatches c10d::send, recv c10d::recv_).
"""

import math
import resource
import time
import weakref
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
# op -> (kind, where its input tensors are, where its group is)
OPS = {
    c10d._allgather_base_: ("all_gather", 1, 2),
    c10d.allgather_: ("all_gather", 1, 2),
    c10d.allgather_into_tensor_coalesced_: ("all_gather", 1, 2),
    c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_: ("reduce_scatter", 1, 2),
    c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1, 2),
    c10d.allreduce_: ("all_reduce", 0, 1),
    c10d.allreduce_coalesced_: ("all_reduce", 0, 1),
    c10d.alltoall_base_: ("all_to_all", 1, 2),
    c10d.alltoall_: ("all_to_all", 1, 2),
    c10d.send: ("send_recv", 0, None),
    funcol.all_gather_into_tensor: ("all_gather", 0, 2),
    funcol.all_gather_into_tensor_coalesced: ("all_gather", 0, 2),
    funcol.reduce_scatter_tensor: ("reduce_scatter", 0, 3),
    funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", 0, 3),
    funcol.all_reduce: ("all_reduce", 0, 2),
    funcol.all_reduce_coalesced: ("all_reduce", 0, 2),
    funcol.all_to_all_single: ("all_to_all", 0, 3),
}
KINDS = tuple(dict.fromkeys(kind for kind, _, _ in OPS.values()))  # the kinds, in this order


def _nbytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(group):
    if isinstance(group, int):  # funcol's group_size
        return group
    if isinstance(group, str):
        return torch._C._distributed_c10d._resolve_process_group(group).size()
    return dist.ProcessGroup.unbox(group).size()  # the dispatcher passes a boxed group


class CommCounter(TorchDispatchMode):
    """Bytes each kind of collective puts in, on this rank, while the mode is on."""

    def __init__(self):
        super().__init__()
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = {}  # "kind/ranks" -> [calls, bytes]: what a latency-bandwidth model needs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # a DTensor op: let DTensor run it first (as CommDebugMode does); the
            # collectives it runs inside (an implicit redistribute) then come back here
            return NotImplemented
        found = OPS.get(func._overloadpacket)
        if found is not None:
            kind, where, group = found
            ranks = _group_size(args[group]) if group is not None else 2
            if ranks > 1:
                self.bytes[kind] += _nbytes(args[where])
                calls = self.calls.setdefault(f"{kind}/{ranks}", [0, 0])
                calls[0] += 1
                calls[1] += _nbytes(args[where])
        return func(*args, **(kwargs or {}))


class SavedBytes:
    """Peak bytes of the tensors autograd keeps for backward (saved_tensors_hooks), each
    storage once, parameters (and views of them) left out. A checkpointed block keeps
    its input (seen); what it recomputes in the backward pass lives only there, through
    hooks of its own (not seen: it is not kept from forward to backward).

    And FSDP2's gathered parameters with their gradients: while a group is gathered, the
    module's parameters are FSDP2's unsharded copies, not the shards the model was built
    with (it frees a copy by resizing its storage to nothing, which no hook sees). At every
    tensor saved or used again, and after every gradient a copy gets, the module's current
    parameters are looked at and the copies' storages and gradients added up, the peak
    kept."""

    def __init__(self, module):
        self.module = module
        self.skip = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.live, self.refs, self.now, self.peak = {}, {}, 0, 0
        self.gathered, self.unsharded_peak = {}, 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def sample(self):
        for p in self.module.parameters():  # FSDP2's unsharded copies, if gathered now
            if _local(p).untyped_storage().data_ptr() not in self.skip and id(p) not in self.gathered:
                self.gathered[id(p)] = p  # and counted again as each gradient lands
                p.register_post_accumulate_grad_hook(lambda _: self.sample())
        now = 0
        for p in self.gathered.values():
            now += _local(p).untyped_storage().nbytes()
            if p.grad is not None:
                now += _local(p.grad).untyped_storage().nbytes()
        self.unsharded_peak = max(self.unsharded_peak, now)

    def unpack(self, held):
        self.sample()
        return held.tensor

    def pack(self, tensor):
        held = _Held(tensor)
        local = _local(tensor)
        base = tensor if tensor._base is None else tensor._base
        if local.device.type == "meta":
            return held
        if base.is_leaf and base.requires_grad:  # a parameter or a view of one
            self.sample()
            return held
        key = local.untyped_storage().data_ptr()
        if key in self.skip:
            return held
        if self.refs.get(key, 0) == 0:
            self.live[key] = local.untyped_storage().nbytes()
            self.now += self.live[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(held, self.release, key)
        self.sample()
        return held

    def release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.live.pop(key)


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _local(t):
    """The plain tensor under a DTensor (and under a collective's pending result)."""
    while is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


def _bytes_of(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _rss():
    """This process's resident bytes now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _max_rss():
    """Its largest resident bytes so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device):
    """Wait for the work queued on the device: a CUDA kernel returns before it has run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(m, k, n, dtype, device, repeats=5):
    """FLOP/s of this process's best (m x k) @ (k x n) matmul, in the run's dtype, on the
    run's device (a measured rate at the MLP's shape, not a data-sheet peak)."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(10):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / 10)
    return 2 * m * k * n / best


def _window(a, b, device, seconds, started=None):
    """FLOP/s of a @ b run again and again for `seconds` from `started` (time.time(); None:
    now), in whole matmuls: the last one ends the window."""
    synchronize(device)
    started, done = started or time.time(), 0
    while True:
        a @ b
        done += 1
        synchronize(device)
        elapsed = time.time() - started
        if elapsed >= seconds:
            return 2 * a.shape[0] * a.shape[1] * b.shape[1] * done / elapsed


def shared_rate(a, b, device, seconds):
    """FLOP/s this rank gets from a @ b in a window of `seconds` that every rank spends on the
    same matmul: the rate of a rank while all of them compute and share whatever cores the
    machine has left them, measured now. A timing of its own between two steps, never of a
    step. The window starts at one moment of the machine's clock for every rank (rank 0's
    time, sent to all): a rank the scheduler wakes late from the broadcast has lost that time,
    and its rate shows it."""
    a @ b  # its first call allocates
    start = torch.tensor([time.time() + 0.01], dtype=torch.float64, device=device)
    dist.broadcast(start, src=0)
    started = start.item()
    time.sleep(max(0.0, started - time.time()))
    return _window(a, b, device, seconds, started)


def alone_rate(a, b, device, seconds):
    """The same window with this rank alone computing: the ranks take turns, the others wait
    in a barrier (a wait that uses no core)."""
    a @ b
    rate = 0.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            rate = _window(a, b, device, seconds)
    dist.barrier()
    return rate


class Meter:
    """train.py --cost: count one step (the second: the first builds AdamW's state lazily)
    and time every step; rank 0 prints the prediction first and the comparison last, and
    report() returns it all on rank 0 (for train.py --report)."""

    def __init__(self, config, layout, args, stage, optimizer, prediction, enabled=True):
        self.enabled = enabled
        if not enabled:
            return
        self.config, self.layout, self.args = config, layout, args
        self.stage, self.optimizer = stage, optimizer
        self.begun, self.counted = 0, False  # the second step this run takes is counted
        self.counter, self.saved = CommCounter(), SavedBytes(stage)
        self.seconds, self.grad_bytes, self.cuda_growth = [], 0, None
        optimizer.register_step_pre_hook(self._grads)
        self.prediction = prediction  # cost_model.predict: every rank's bytes, memory; FLOPs
        self.rss_before = _rss()
        rows = args.batch // layout.data_parallel * config.seq // layout.cp
        dist.barrier()  # every rank times its matmul at once: the same contention as training
        self.device = next(stage.parameters()).device
        # the dtype the step's matmuls run in: bfloat16 under --bf16 (FSDP2 casts the float32
        # parameters), where a float32 rate would be far lower on a GPU (no tensor cores)
        self.peak_dtype = torch.bfloat16 if args.bf16 else getattr(torch, args.dtype)
        self.peak_shape = (rows, config.dim, config.ffn * config.dim)
        self.peak = matmul_peak(*self.peak_shape, self.peak_dtype, self.device)
        # --rate-window: the same matmul timed by every rank at once before each step
        self.window, self.windows = args.rate_window, []
        self.pair = [torch.randn(r, c, dtype=self.peak_dtype, device=self.device)
                     for r, c in ((rows, config.dim), (config.dim, config.ffn * config.dim))
                     if self.window]
        self.alone = alone_rate(*self.pair, self.device, self.window) if self.window else None
        if dist.get_rank() == 0:
            mine = self.prediction["bytes"][0]
            print("cost predicted, rank 0: " + ", ".join(f"{k} {v} B" for k, v in mine.items())
                  + f"; {self.prediction['flops']:.3g} FLOPs a step", flush=True)

    def _grads(self, optimizer, args, kwargs):
        self.grad_bytes = _bytes_of(p.grad for g in optimizer.param_groups for p in g["params"])

    def begin(self, step):
        if self.enabled:
            self.begun += 1
            if self.window:  # before the step's clock and its counters start
                self.windows.append(shared_rate(*self.pair, self.device, self.window))
            if self.begun == 2:
                self.counter.__enter__()
                self.saved.hooks.__enter__()
                if self.device.type == "cuda":  # the allocator's own count, from here
                    synchronize(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
                    self.cuda_start = torch.cuda.memory_allocated(self.device)
            synchronize(self.device)
            self.started = time.perf_counter()

    def end(self, step):
        if not self.enabled:
            return
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self.started)
        if self.begun == 2:
            if self.device.type == "cuda":
                self.cuda_growth = torch.cuda.max_memory_allocated(self.device) - self.cuda_start
            self.saved.hooks.__exit__(None, None, None)
            self.counter.__exit__(None, None, None)
            self.counted = True

    def measured(self):
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return {"parameters": _bytes_of(self.stage.parameters()), "gradients": self.grad_bytes,
                "optimizer": _bytes_of(state), "activations": self.saved.peak,
                "unsharded": self.saved.unsharded_peak,
                "peak_rss_growth": _max_rss() - self.rss_before,
                "cuda_peak_growth": self.cuda_growth}

    def report(self):
        if not self.enabled:
            return None
        if not self.counted:
            if dist.get_rank() == 0:
                print("cost, nothing counted: --cost counts the second step of a run", flush=True)
            return None
        # timed again after the last step, every rank at once, and the best kept: a rank that
        # shares its core (another job) may time one of the two while the core is taken, and a
        # peak below the steps' own rate would put the MFU over 1
        dist.barrier()
        self.peak = max(self.peak, matmul_peak(*self.peak_shape, self.peak_dtype, self.device))
        mine = {"bytes": self.counter.bytes, "calls": self.counter.calls,
                "memory": self.measured(), "peak_flops": self.peak, "seconds": self.seconds,
                "windows": self.windows, "alone": self.alone}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if dist.get_rank() != 0:
            return None
        predicted = self.prediction
        for kind in KINDS:
            p, c = (sum(r[kind] for r in x) for x in (predicted["bytes"], [e["bytes"] for e in every]))
            same = all(a[kind] == e["bytes"][kind] for a, e in zip(predicted["bytes"], every))
            print(f"cost {kind}: predicted {p} B, counted {c} B (all ranks)"
                  + ("" if same else ", ranks differ"), flush=True)
        print(f"cost memory predicted for {predicted['device']} ({predicted['attention']} "
              "attention kernel)", flush=True)
        for part in ("parameters", "gradients", "optimizer", "activations", "unsharded"):
            ratio = max(e["memory"][part] / p[part] if p[part] else float(e["memory"][part] == 0)
                        for e, p in zip(every, predicted["memory"]))  # (1: nothing, as predicted)
            print(f"cost {part}: predicted {predicted['memory'][0][part]} B, measured "
                  f"{every[0]['memory'][part]} B (rank 0); measured / predicted at most {ratio:.3f}")
        if every[0]["memory"]["cuda_peak_growth"] is not None:
            # what a step adds to the allocator's peak above what its start holds (the
            # parameters and AdamW's state): its gradients, activations and FSDP2's gathered
            # copies, and all it does not predict (the gradients of the activations, the
            # logits, the communication buffers, the allocator's rounding)
            ratio = max(e["memory"]["cuda_peak_growth"]
                        / max(p["gradients"] + p["activations"] + p["unsharded"], 1)
                        for e, p in zip(every, predicted["memory"]))
            print(f"cost cuda peak: max_memory_allocated {every[0]['memory']['cuda_peak_growth']} B "
                  "above the step's start (rank 0); over predicted gradients + activations + "
                  f"unsharded at most {ratio:.3f}", flush=True)
        # the first step builds AdamW's state, the counted one runs under the counters
        after = 2
        timed = sorted(s for e in every for s in e["seconds"][after:]) or every[0]["seconds"]
        step = timed[len(timed) // 2]
        peak = min(e["peak_flops"] for e in every)
        mfu = predicted["flops"] / step / (peak * self.layout.world)
        # the windows before the timed steps: all ranks at the slowest one's rate in each (a
        # step waits for its slowest rank), their median
        shared = sorted(len(every) * min(e["windows"][i] for e in every)
                        for i in range(after, len(self.windows)))
        print(f"cost flops: {predicted['flops']:.4g} a step in {step * 1e3:.1f} ms; matmul peak "
              f"{peak / 1e9:.2f} GFLOP/s a rank in {str(self.peak_dtype).removeprefix('torch.')}; "
              f"model FLOPs / measured matmul rate {mfu:.3f}")
        if shared:
            alone = sum(e["alone"] for e in every) / len(every)
            print(f"cost rate: all {self.layout.world} ranks at once got "
                  f"{shared[len(shared) // 2] / 1e9:.2f} GFLOP/s together at the slowest one's pace "
                  f"(the median of {len(shared)} windows of {self.window:g} s before the timed steps), one alone "
                  f"{alone / 1e9:.2f} GFLOP/s (the ranks' mean)", flush=True)
        return {"predicted": predicted, "counted": [e["bytes"] for e in every],
                "calls": [e["calls"] for e in every], "memory": [e["memory"] for e in every],
                "step_seconds": step, "peak_flops": peak, "mfu": mfu,
                "peak_dtype": str(self.peak_dtype).removeprefix("torch."),
                "shared_flops": shared[len(shared) // 2] if shared else None,
                "alone_flops": sum(e["alone"] for e in every) / len(every) if shared else None,
                "shared_windows": [[e["windows"][i] for e in every] for i in range(len(self.windows))],
                "first_step_seconds": max(e["seconds"][0] for e in every),
                "layout": asdict(self.layout), "microbatches": self.args.microbatches}
