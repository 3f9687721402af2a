"""Data parallelism by hand: gradient averaging, gradient buckets, a parameter server.

Each piece is checked against PyTorch's own machinery: averaging gradients with
the hand-written ring after ``backward()`` gives the parameters of
``DistributedDataParallel`` and of one process on the full batch.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ddpguide.collectives.algorithms import all_reduce
from ddpguide.core.models import ToyModel
from ddpguide.core.runtime import worker_device

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4: equal shards for every world size used here


def toy_batches(steps: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                batch: int = GLOBAL_BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``steps`` random (input, target) batches for ToyModel on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 10, generator=generator, dtype=dtype),
             torch.randn(batch, 5, generator=generator, dtype=dtype)) for _ in range(steps)]


def shard(batch: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Contiguous piece ``index`` of ``count`` (what a sampler gives each rank)."""
    return batch.tensor_split(count)[index]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, where backward has filled it."""
    assert p.grad is not None, "a parameter without a gradient"
    return p.grad


def average_gradients(model: nn.Module, algorithm: str = "ring", group=None) -> None:
    """After ``backward()``: sum each gradient over the ranks by hand, divide by N.

    Every rank then holds the gradient of the mean loss over the global batch,
    so identical optimizer steps keep the replicas identical.
    """
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            all_reduce(p.grad, algorithm, group)
            p.grad.div_(world)


class BucketedGradientSync:
    """DDP's reducer in miniature: all-reduce gradients in buckets, during backward.

    A hook on every parameter fires as soon as its gradient is accumulated.
    When the last gradient of a bucket is ready, the bucket is flattened and
    its all-reduce starts asynchronously, while backward goes on computing the
    gradients of earlier layers. Buckets are filled from the last parameter
    backwards because that is the order in which backward produces gradients.
    :meth:`finish` waits for the all-reduces and writes the averages back.
    """

    def __init__(self, model: nn.Module, bucket_cap_bytes: int = 25 * 2**20, group=None):
        self.group = group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in named}
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for _, p in reversed(named):
            if size >= bucket_cap_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending: dict[int, tuple] = {}
        self.launches: list[tuple[int, list[str], int]] = []  # (bucket, names, grads not yet ready)
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def _on_gradient_ready(self, p: nn.Parameter) -> None:
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] < len(self.buckets[i]):
            return
        flat = torch.cat([_grad(q).reshape(-1) for q in self.buckets[i]])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.pending[i] = (work, flat)
        not_ready = sum(len(b) for b in self.buckets) - sum(self.ready)
        self.launches.append((i, [self.names[q] for q in self.buckets[i]], not_ready))

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and put the averaged gradients back."""
        if len(self.pending) != len(self.buckets):
            missing = sorted(set(range(len(self.buckets))) - set(self.pending))
            raise RuntimeError(f"buckets {missing} never became ready: a parameter got no gradient "
                               "(DDP's find_unused_parameters=True handles that case)")
        world = dist.get_world_size(self.group)
        for i, (work, flat) in sorted(self.pending.items()):
            work.wait()
            flat.div_(world)
            parts = flat.split([q.numel() for q in self.buckets[i]])
            for q, part in zip(self.buckets[i], parts):
                grad = _grad(q)
                grad.copy_(part.view_as(grad))
        self.pending.clear()
        self.ready = [0] * len(self.buckets)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, after_backward: Callable[[], None] | None = None) -> None:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_with_ddp(steps: int = 3, dtype: torch.dtype = torch.float32, lr: float = 0.1,
                     algorithm: str = "ring", bucket_cap_bytes: int = 256) -> dict:
    """Worker: train ToyModel four ways from the same start on the same data.

    ``by_hand``: :func:`average_gradients` with ``algorithm`` after backward;
    ``ddp``: ``DistributedDataParallel``; ``bucketed``: :class:`BucketedGradientSync`;
    ``single``: one process on the full batch (each rank computes it). Returns
    each model's parameters, and the bucket launches of the last step.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), worker_device()
    torch.manual_seed(0)
    base = ToyModel().to(device, dtype)
    models = {name: copy.deepcopy(base) for name in ("by_hand", "ddp", "bucketed", "single")}
    ddp = DDP(models["ddp"], device_ids=[device] if device.type == "cuda" else None)
    sync = BucketedGradientSync(models["bucketed"], bucket_cap_bytes)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=lr) for name, m in models.items()}
    for x, y in toy_batches(steps, dtype):
        x, y = x.to(device), y.to(device)
        xs, ys = shard(x, rank, world), shard(y, rank, world)
        _train_step(models["by_hand"], optimizers["by_hand"], xs, ys,
                    lambda: average_gradients(models["by_hand"], algorithm))
        _train_step(ddp, optimizers["ddp"], xs, ys)
        sync.launches.clear()
        _train_step(models["bucketed"], optimizers["bucketed"], xs, ys, sync.finish)
        _train_step(models["single"], optimizers["single"], x, y)
    result: dict[str, Any] = {name: _parameters(m) for name, m in models.items()}
    result["bucket_launches"] = list(sync.launches)
    return result


def parameter_server(steps: int = 3, dtype: torch.dtype = torch.float32, lr: float = 0.1) -> dict:
    """Worker: rank 0 is a parameter server, ranks 1..N-1 compute gradients.

    Each step the server broadcasts the parameters, every worker pushes the
    gradient of its shard of the global batch to the server (point-to-point),
    and the server averages them and takes the SGD step. Returns this rank's
    final parameters and, for comparison, plain SGD on one process.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError("a parameter server needs at least 2 ranks (1 server, 1 worker)")
    workers, device = world - 1, worker_device()
    torch.manual_seed(0)
    model = ToyModel().to(device, dtype)
    reference = copy.deepcopy(model)
    flat = parameters_to_vector(model.parameters()).detach()
    batches = [(x.to(device), y.to(device)) for x, y in toy_batches(steps, dtype)]
    for x, y in batches:
        dist.broadcast(flat, src=0)  # pull: everyone gets the current parameters
        if rank == 0:
            inbox = [torch.empty_like(flat) for _ in range(workers)]
            requests = [dist.irecv(buf, src=w) for w, buf in enumerate(inbox, 1)]
            total = torch.zeros_like(flat)
            for request, buf in zip(requests, inbox):  # add in worker order
                assert request is not None  # None only for a rank outside the group
                request.wait()
                total.add_(buf)
            flat.add_(total / workers, alpha=-lr)
        else:
            vector_to_parameters(flat, model.parameters())
            model.zero_grad()
            xs, ys = shard(x, rank - 1, workers), shard(y, rank - 1, workers)
            nn.functional.mse_loss(model(xs), ys).backward()
            dist.send(parameters_to_vector(_grad(p) for p in model.parameters()), dst=0)  # push
    dist.broadcast(flat, src=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for x, y in batches:
        _train_step(reference, optimizer, x, y)
    return {"parameters": flat, "single": parameters_to_vector(reference.parameters()).detach()}


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds ``fn`` takes. On CUDA a collective returns once it is queued, so the two ends
    are events on the compute stream, which waits for each all-reduce's result (not
    ``torch.cuda.synchronize()``, which would also wait for whatever else NCCL's streams run)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    begin.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return float(begin.elapsed_time(end)) / 1e3


def bucketing_savings(layers: int = 64, width: int = 8, repeats: int = 15,
                      algorithm: str = "library") -> dict:
    """Worker: one all-reduce per parameter vs one flattened bucket, same gradients.

    The model has ``2 * layers`` small parameters; each all-reduce pays a fixed
    latency, so many small ones cost more than one that carries everything.
    ``algorithm`` is ``"library"`` (``dist.all_reduce``) or a hand-written one.
    Returns the median seconds of both (slowest rank per repeat) and their ratio.
    """
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(worker_device())
    grads = [torch.randn_like(p) for p in model.parameters()]

    def reduce(t: torch.Tensor) -> None:
        if algorithm == "library":
            dist.all_reduce(t)
        else:
            all_reduce(t, algorithm)

    def per_parameter() -> None:
        for g in grads:
            reduce(g)

    def one_bucket() -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    cases = {"per_parameter": per_parameter, "one_bucket": one_bucket}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):
        for name, fn in cases.items():  # interleaved, so noise hits both alike
            dist.barrier()
            seconds = _timed(fn, grads[0].device)
            if repeat:  # the first round warms up
                samples[name].append(seconds)
    times = torch.tensor([samples[name] for name in cases], dtype=torch.float64,
                         device=grads[0].device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    medians = {name: statistics.median(times[i].tolist()) for i, name in enumerate(cases)}
    return {"parameters": len(grads), "bytes": sum(g.numel() * g.element_size() for g in grads),
            **{f"{name}_s": t for name, t in medians.items()},
            "ratio": medians["per_parameter"] / medians["one_bucket"]}
