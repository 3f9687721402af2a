"""The mistakes that make DDP jobs hang or quietly train wrong, each as a runnable check.

Every ``check_*`` function reproduces one mistake next to its fix and returns
a :class:`Finding` whose ``symptom`` is one line (no traceback). Checks that
need several processes start them with :func:`ddpguide.launch.spawn` and are
bounded in time; the hang of "evaluation on rank 0 only" is shown with a
collective timeout of a few seconds, so it ends in an error message instead.

The list (after the closing checklist of the mixed-precision source article):

* ``set_epoch`` forgotten: every epoch repeats the first epoch's order;
* every rank prints and saves: N copies of each line, N writers of one file;
* evaluation called on rank 0 only: rank 0 waits in the collective forever;
* the process group never destroyed: the next run in the same process fails;
* batch norm not converted: every rank normalises with its own small batch;
* loader workers seeded alike on every rank: the same "random" augmentations;
* padding and ``drop_last``: repeated or missing samples;
* evaluation through a padded sampler: more samples counted than exist.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from .data import UnpaddedDistributedSampler, rank_generator, train_loader
from .launch import spawn
from .models import ToyModel
from .ranklog import rank_print
from .runtime import DistEnv, select_runtime
from .train import TrainConfig, evaluate, fit


@dataclass
class Finding:
    """One pitfall: whether its symptom was reproduced, in one line, and the fix."""

    pitfall: str
    shown: bool
    symptom: str
    fix: str
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        mark = "reproduced" if self.shown else "NOT reproduced"
        return f"{self.pitfall} [{mark}]: {self.symptom} | fix: {self.fix}"


def _one_line(exc: BaseException) -> str:
    """The last line of an error message, without the C++ source location gloo prefixes."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text.split("] ", 1)[-1] if text.startswith("[") else text


# --- set_epoch ---------------------------------------------------------------

def epoch_orders(dataset_size: int = 8, world_size: int = 2, epochs: int = 3,
                 call_set_epoch: bool = True, rank: int = 0) -> list[list[int]]:
    """The sample indices ``rank`` sees in each epoch of :func:`ddpguide.data.train_loader`."""
    dataset = TensorDataset(torch.arange(dataset_size))
    loader = train_loader(dataset, batch_size=dataset_size, rank=rank, world_size=world_size)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            loader.sampler.set_epoch(epoch)
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


# --- printing and saving on every rank -----------------------------------------

def printing_and_saving_worker(directory: str) -> dict:
    """Spawned: print and save once the naive way (every rank), once the right way (rank 0)."""
    env = DistEnv.from_environ()
    log = Path(directory) / "writers.log"

    def save(name: str) -> None:
        torch.save({"epoch": 0}, Path(directory) / name)
        with open(log, "a") as f:  # O_APPEND: one whole line per writer
            f.write(f"{name} rank{env.rank}\n")

    print(f"[rank {env.rank}] epoch 1 done (naive print)", flush=True)
    save("naive.pt")
    dist.barrier()
    rank_print("epoch 1 done (rank_print)")
    if env.is_main:
        save("rank0.pt")
    dist.barrier()
    return {"rank": env.rank, "naive_prints": 1, "rank0_prints": int(env.is_main)}


def check_printing_and_saving(world_size: int = 2) -> Finding:
    """Every rank runs the same script: unguarded prints and saves happen N times."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-pitfall-") as directory:
        results = spawn(printing_and_saving_worker, world_size, directory, timeout=120)
        writers = Path(directory, "writers.log").read_text().split()
    naive_writers = sum(1 for word in writers if word == "naive.pt")
    rank0_writers = sum(1 for word in writers if word == "rank0.pt")
    naive_prints = sum(r["naive_prints"] for r in results)
    rank0_prints = sum(r["rank0_prints"] for r in results)
    return Finding(
        "printing and saving on every rank",
        naive_prints == world_size and naive_writers == world_size and rank0_writers == 1,
        f"{world_size} ranks printed the line {naive_prints} times and wrote the checkpoint "
        f"{naive_writers} times",
        "print with rank_print (or if rank == 0) and save only on rank 0",
        {"naive_prints": naive_prints, "rank0_prints": rank0_prints,
         "naive_writers": naive_writers, "rank0_writers": rank0_writers})


# --- evaluation on rank 0 only -----------------------------------------------------

def _fresh_default_group(name: str, timeout_s: float) -> None:
    """Replace the default group by one with ``timeout_s``, rendezvousing under ``name``."""
    env = DistEnv.from_environ()
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=env.rank,
                            world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def toy_eval_set(size: int) -> TensorDataset:
    """``size`` random inputs for :class:`~ddpguide.models.ToyModel` with labels 0-4 (fixed seed)."""
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(size, 10, generator=generator),
                         torch.randint(0, 5, (size,), generator=generator))


def rank0_evaluation_worker(timeout_s: float) -> dict:
    """Spawned: evaluation on rank 0 only (fails after ``timeout_s``), then on every rank."""
    env = DistEnv.from_environ()
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = ToyModel()
    data = toy_eval_set(50)
    # The mistake, on a group whose collectives give up after timeout_s:
    _fresh_default_group("rank0-only", timeout_s)
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    error, waited = "", 0.0
    if env.is_main:
        started = time.monotonic()
        try:
            evaluate(model, data, 16, env, device)
        except RuntimeError as exc:
            error = _one_line(exc)
        waited = time.monotonic() - started
        store.set("pitfall/rank0-evaluated", "1")
    else:
        # The other ranks skip evaluation; they must not start another collective
        # on this group (it would pair with rank 0's all-reduce), so they wait here.
        store.wait(["pitfall/rank0-evaluated"], datetime.timedelta(seconds=60))
    # The fix: every rank evaluates its shard, on a fresh group.
    _fresh_default_group("every-rank", 60)
    correct, total = evaluate(model, data, 16, env, device)
    return {"error": error, "waited_s": waited, "correct": correct, "total": total}


def check_rank0_only_evaluation(world_size: int = 2, timeout_s: float = 3.0) -> Finding:
    """An evaluation that ends in a collective, called on rank 0 only, waits for partners forever.

    Shown on gloo with a ``timeout_s`` collective timeout. On nccl the
    watchdog aborts the process after the group's timeout instead of raising.
    """
    results = spawn(rank0_evaluation_worker, world_size, timeout_s, backend="gloo",
                    device_type="cpu", timeout=120 + timeout_s)
    first = results[0]
    return Finding(
        "evaluation on rank 0 only", bool(first["error"]) and first["total"] == 50,
        f"rank 0 waited {first['waited_s']:.1f} s in evaluate()'s all_reduce, then: "
        f"{first['error']}",
        "call evaluate() on every rank; print the reduced result on rank 0",
        first)


# --- process group never destroyed -------------------------------------------------

def check_destroy_process_group() -> Finding:
    """A process group left behind makes the next ``init_process_group`` in this process fail.

    Notebooks, sweeps and tests run several jobs in one process. Uses a
    single-rank gloo group, so it needs no other process; refuses to run
    where a default group exists already.
    """
    if dist.is_initialized():
        raise RuntimeError("check_destroy_process_group needs a process without a process group")
    timeout = datetime.timedelta(seconds=10)

    def start() -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)

    start()  # first job, which forgets dist.destroy_process_group()
    error = ""
    try:
        start()  # the next job in the same process
    except (ValueError, RuntimeError) as exc:
        error = _one_line(exc)
    dist.destroy_process_group()
    start()  # with the group destroyed, the next job starts fine
    dist.destroy_process_group()
    return Finding(
        "process group not destroyed", bool(error),
        f"the next init_process_group raised: {error}",
        "call dist.destroy_process_group() when the job ends (in a finally block)",
        {"error": error})


# --- loader workers seeded alike ------------------------------------------------------

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

    Every rank seeds torch identically (as it must, for identical model
    initialisation); without a generator of its own, each loader takes its
    workers' base seed from that shared state.
    """
    torch.manual_seed(seed)
    dataset = RandomAugmentation(dataset_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
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
        "give each rank's DataLoader its own generator (ddpguide.data.rank_generator)",
        {"without": alike, "with": distinct})


# --- padding, drop_last and exact evaluation counts ------------------------------------

def shard_indices(dataset_size: int, world_size: int, drop_last: bool = False,
                  padded: bool = True) -> list[list[int]]:
    """Each rank's indices: ``DistributedSampler`` (unshuffled) or the unpadded sampler."""
    if not padded:
        return [list(UnpaddedDistributedSampler(dataset_size, world_size, r))
                for r in range(world_size)]
    dataset = range(dataset_size)
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
    """Spawned: what ``ddpguide.train.evaluate`` counts, and what a padded sampler would count."""
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
        "evaluate over unpadded shards (ddpguide.data.eval_loader) and all-reduce the counts",
        {"counts": counts})


# --- batch norm not synchronised --------------------------------------------------------

def batchnorm_worker(config: TrainConfig) -> dict:
    """Spawned: the same short run with synchronised and with per-rank batch norm."""
    return {"sync": fit(replace(config, sync_bn=True)).parameters,
            "local": fit(replace(config, sync_bn=False)).parameters}


def largest_gap(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest difference between two state dicts, relative to each tensor's scale (at least 1)."""
    return max(((ours[k].float() - v.float()).abs().max() / v.float().abs().max().clamp(min=1))
               .item() for k, v in reference.items())


def check_sync_bn(world_size: int = 2, batch_size: int = 32, steps: int = 3) -> Finding:
    """Per-rank batch norm drifts from one process on the whole batch; synchronised BN does not.

    ``world_size`` ranks with ``batch_size`` samples each see, step for step,
    the samples one process sees with ``world_size * batch_size`` (the
    samplers deal out one shared permutation), so with synchronised batch norm
    the two runs are the same computation up to rounding.
    """
    config = TrainConfig(batch_size=batch_size, epochs=1, max_steps_per_epoch=steps,
                         dataset="digits", evaluate=False, log=False)
    ranks = spawn(batchnorm_worker, world_size, config, timeout=240)
    whole = fit(replace(config, batch_size=batch_size * world_size)).parameters
    sync, local = largest_gap(ranks[0]["sync"], whole), largest_gap(ranks[0]["local"], whole)
    ranks_agree = all(largest_gap(r["sync"], ranks[0]["sync"]) == 0 for r in ranks)
    return Finding(
        "batch norm not synchronised", ranks_agree and local > 10 * sync,
        f"after {steps} steps the weights differ from one process on the whole batch by "
        f"{local:.1e} with per-rank BN, {sync:.1e} with synchronised BN",
        "convert_sync_batchnorm(model, device_type) before wrapping in DDP (TrainConfig(sync_bn=True))",
        {"sync_gap": sync, "local_gap": local, "ranks_agree": ranks_agree})
