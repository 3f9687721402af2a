"""The data-side pitfalls of a DDP script as checks: ``set_epoch``, per-rank loader
seeds, a padding sampler, what evaluation counts, and why ranks need no common seed.

Each check builds the bug and its fix and returns a :class:`~ddpguide.ddp.pitfalls.Finding`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from ddpguide.core.data import UnpaddedDistributedSampler, rank_generator, train_loader
from ddpguide.core.models import ToyModel
from ddpguide.core.runtime import DistEnv, select_runtime
from ddpguide.ddp.pitfalls import Finding, toy_eval_set
from ddpguide.launch.spawn import spawn
from ddpguide.train.loop import evaluate


def epoch_orders(dataset_size: int = 8, world_size: int = 2, epochs: int = 3,
                 call_set_epoch: bool = True, rank: int = 0) -> list[list[int]]:
    """The sample indices ``rank`` sees in each epoch of :func:`ddpguide.data.train_loader`."""
    dataset = TensorDataset(torch.arange(dataset_size))
    loader = train_loader(dataset, batch_size=dataset_size, rank=rank, world_size=world_size)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler = loader.sampler
            assert isinstance(sampler, DistributedSampler)  # train_loader's
            sampler.set_epoch(epoch)
        orders.append([int(i) for (batch,) in loader for i in batch])
    return orders


def check_set_epoch(dataset_size: int = 8, world_size: int = 2, epochs: int = 3) -> Finding:
    """Without ``sampler.set_epoch(epoch)`` the shuffle is the same in every epoch."""
    without = epoch_orders(dataset_size, world_size, epochs, call_set_epoch=False)
    with_it = epoch_orders(dataset_size, world_size, epochs, call_set_epoch=True)
    repeated = all(order == without[0] for order in without)
    reshuffled = len({tuple(order) for order in with_it}) > 1
    return Finding(
        "set_epoch forgotten", repeated and reshuffled,
        f"rank 0 sees {without[0]} in all {epochs} epochs",
        "call loader.sampler.set_epoch(epoch) at the start of every epoch",
        {"without": without, "with": with_it})


class RandomAugmentation(Dataset):
    """Returns (index, a random number drawn in the loader worker): a stand-in for an augmentation."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, float]:
        return index, float(torch.rand(()))


def worker_draws(rank: int, world_size: int, per_rank_generator: bool, num_workers: int = 2,
                 dataset_size: int = 8, seed: int = 0) -> list[float]:
    """The random numbers the loader workers of ``rank`` draw in the first epoch.

    Every rank seeds torch identically here (scripts often do, though DDP
    does not need it: see :func:`check_ddp_broadcast`); without a generator
    of its own, each loader takes its workers' base seed from that shared state.
    """
    torch.manual_seed(seed)
    dataset = RandomAugmentation(dataset_size)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                                          shuffle=False)
    generator = rank_generator(rank) if per_rank_generator else None
    loader = DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=num_workers,
                        generator=generator, multiprocessing_context="fork"
                        if os.name == "posix" else None)
    return [round(float(value), 6) for _, value in loader]


def check_worker_seeds(world_size: int = 2, num_workers: int = 2) -> Finding:
    """Without a per-rank generator, worker k of every rank draws the same random numbers."""
    alike = [worker_draws(r, world_size, False, num_workers) for r in range(world_size)]
    distinct = [worker_draws(r, world_size, True, num_workers) for r in range(world_size)]
    same = all(draws == alike[0] for draws in alike)
    different = len({tuple(d) for d in distinct}) == world_size
    return Finding(
        "loader workers seeded alike on every rank", same and different,
        f"different samples, same random draws on all {world_size} ranks: {alike[0][:3]}...",
        "give each rank's DataLoader its own generator (ddpguide.core.data.rank_generator)",
        {"without": alike, "with": distinct})


def shard_indices(dataset_size: int, world_size: int, drop_last: bool = False,
                  padded: bool = True) -> list[list[int]]:
    """Each rank's indices: ``DistributedSampler`` (unshuffled) or the unpadded sampler."""
    if not padded:
        return [list(UnpaddedDistributedSampler(dataset_size, world_size, r))
                for r in range(world_size)]
    dataset = TensorDataset(torch.arange(dataset_size))  # the sampler only reads its length
    return [list(DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=False,
                                    drop_last=drop_last)) for r in range(world_size)]


def check_padding(dataset_size: int = 10, world_size: int = 3) -> Finding:
    """DistributedSampler evens the shards out: padding repeats samples, drop_last drops some."""
    padded = shard_indices(dataset_size, world_size)
    dropped = shard_indices(dataset_size, world_size, drop_last=True)
    exact = shard_indices(dataset_size, world_size, padded=False)
    repeats = sum(map(len, padded)) - dataset_size
    missing = dataset_size - sum(map(len, dropped))
    exact_ok = sorted(i for shard in exact for i in shard) == list(range(dataset_size))
    return Finding(
        "padding and drop_last", repeats > 0 and missing > 0 and exact_ok,
        f"{dataset_size} samples on {world_size} ranks: padding repeats {repeats}, "
        f"drop_last drops {missing}",
        "train with either (DDP needs equal batch counts); evaluate with unpadded shards",
        {"padded": padded, "drop_last": dropped, "unpadded": exact})


def evaluation_count_worker(dataset_size: int, batch_size: int = 7) -> dict:
    """Spawned: what ``ddpguide.train.loop.evaluate`` counts, and what a padded sampler would count."""
    env = DistEnv.from_environ() if dist.is_initialized() else DistEnv.single()
    device = select_runtime(env.local_world_size).device(env.local_rank)
    torch.manual_seed(0)
    model = ToyModel().to(device)
    data = toy_eval_set(dataset_size)
    correct, total = evaluate(model, data, batch_size, env, device)
    padded = torch.tensor(len(DistributedSampler(data, num_replicas=env.world_size,
                                                 rank=env.rank, shuffle=False)), device=device)
    if dist.is_initialized():
        dist.all_reduce(padded)
    return {"correct": correct, "total": total, "padded_total": int(padded)}


def check_evaluation_count(world_sizes: tuple[int, ...] = (1, 2, 3),
                           dataset_size: int = 11) -> Finding:
    """``evaluate`` counts each test sample once on any number of ranks; a padded sampler does not."""
    counts = {}
    for world_size in world_sizes:
        if world_size == 1:
            counts[1] = evaluation_count_worker(dataset_size)
        else:
            counts[world_size] = spawn(evaluation_count_worker, world_size, dataset_size,
                                       timeout=120)[0]
    exact = all(c["total"] == dataset_size for c in counts.values())
    same_correct = len({c["correct"] for c in counts.values()}) == 1
    over = {w: c["padded_total"] for w, c in counts.items() if c["padded_total"] != dataset_size}
    return Finding(
        "evaluation through a padded sampler", exact and same_correct and bool(over),
        f"{dataset_size} test samples; a padded sampler counts "
        + ", ".join(f"{n} on {w} ranks" for w, n in over.items()),
        "evaluate over unpadded shards (ddpguide.core.data.eval_loader) and all-reduce the counts",
        {"counts": counts})


# --- seeds and the initial weights ------------------------------------------------------

def broadcast_worker(seed_offset: int) -> dict:
    """Spawned: seed torch with ``rank * seed_offset``, build the ToyModel, wrap it in DDP."""
    from torch.nn.parallel import DistributedDataParallel

    rank = DistEnv.from_environ().rank
    torch.manual_seed(rank * seed_offset)
    model = ToyModel()
    before = [p.detach().clone() for p in model.parameters()]
    wrapped = DistributedDataParallel(model)
    return {"before": before, "after": [p.detach().clone() for p in wrapped.module.parameters()]}


def check_ddp_broadcast(world_size: int = 2) -> Finding:
    """Ranks seeded differently start from different weights; DDP's constructor makes them rank 0's."""
    ranks = spawn(broadcast_worker, world_size, 1000, backend="gloo", device_type="cpu", timeout=120)
    differed = any(not torch.equal(a, b) for r in ranks[1:]
                   for a, b in zip(r["before"], ranks[0]["before"]))
    equal = all(torch.equal(a, b) for r in ranks for a, b in zip(r["after"], ranks[0]["before"]))
    return Finding(
        "ranks seeded differently", differed and equal,
        f"{world_size} ranks built different weights; after DistributedDataParallel(model) "
        "every rank held rank 0's",
        "nothing to fix: DDP broadcasts rank 0's parameters and buffers when it wraps the model",
        {"differed_before": differed, "equal_after": equal})
