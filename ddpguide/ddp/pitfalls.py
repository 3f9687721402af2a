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
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ddpguide.core.commands import one_line
from ddpguide.core.models import ToyModel
from ddpguide.core.ranklog import rank_print
from ddpguide.core.runtime import DistEnv
from ddpguide.launch.spawn import spawn
from ddpguide.train.loop import TrainConfig, evaluate, fit


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


# --- set_epoch ---------------------------------------------------------------


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
    """``size`` random inputs for :class:`~ddpguide.core.models.ToyModel` with labels 0-4 (fixed seed)."""
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
            error = one_line(exc, 10_000, last=True)
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
        error = one_line(exc, 10_000, last=True)
    dist.destroy_process_group()
    start()  # with the group destroyed, the next job starts fine
    dist.destroy_process_group()
    return Finding(
        "process group not destroyed", bool(error),
        f"the next init_process_group raised: {error}",
        "call dist.destroy_process_group() when the job ends (in a finally block)",
        {"error": error})


# --- loader workers seeded alike ------------------------------------------------------


# --- padding, drop_last and exact evaluation counts ------------------------------------


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
