"""Checks of the sharding chapter: equal to one process, and the collectives of one step.

Workers (:func:`equivalence`, :func:`collectives`) run on every rank of a
:func:`ddpguide.launch.spawn`; :func:`check_equivalence` starts them and raises
unless every strategy ends with the weights of one process trained on the full
batch, within the tolerance it is given.

The strategies ``zero2_hand`` and ``zero3_hand`` are the package's own ZeRO by hand
(:mod:`ddpguide.sharding.zero3`: ZeRO-2 as well, tuple outputs, parameter-owning parts,
models on the meta device), not the chapter's program. What the chapter says of the
program ``zero3_by_hand.py`` is counted on the program itself: :func:`program_collectives`
loads it (:func:`ddpguide.launch.programs.load`) and runs its ``make_model`` and
``shard_model``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from ddpguide.core.models import mlp
from ddpguide.core.runtime import worker_device
from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn
from ddpguide.sbp.boxing_by_hand import collective_names
from ddpguide.sharding.memory import measure, step_peaks
from ddpguide.sharding.strategies import build, check_strategy, on_rank_device
from ddpguide.sharding.zero3 import ShardedModel

# Linear(6, 10), Linear(10, 5), Linear(5, 3): 10 and 5 rows do not split evenly over 3
# (or 5 and 3 over 2) ranks, and 10, 5 and 3 elements need padding in flat shards.
EQUIVALENCE_WIDTHS = (6, 10, 5, 3)
SHARDED = ("ddp", "zero1", "zero2_hand", "zero3_hand", "fsdp2")
TOLERANCE = 1e-12
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: every rank gets the same number of samples
#: The chapter's ZeRO-3 program, whose own hooks :func:`program_collectives` counts.
PROGRAM = "zero3_by_hand.py"


def _quiet() -> None:
    # FSDP2 warns that a wrapped Sequential returns a view (an in-place change of the output
    # would skip its backward hook); no check changes an output in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _data(seed: int, batch: int, widths: Sequence[int], dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    return on_rank_device(torch.randn(batch, widths[0], generator=generator, dtype=dtype),
                          torch.randn(batch, widths[-1], generator=generator, dtype=dtype))


def equivalence(strategies: Sequence[str] = SHARDED, steps: int = 3, lr: float = 0.05,
                batch: int = BATCH, seed: int = 0, widths: Sequence[int] = EQUIVALENCE_WIDTHS) -> dict:
    """On each rank: train every strategy on this rank's slice of the batch, in float64.

    The reference, one process on the full batch, is trained on every rank (it
    is small). Returns the largest difference of each strategy's full
    parameters to the reference, the hand-written ZeRO-3 against ``fully_shard``,
    and each strategy's local parameter shapes on this rank.
    """
    _quiet()
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.float64
    inputs, targets = _data(seed, batch, widths, dtype)
    mine = slice(rank * batch // world, (rank + 1) * batch // world)
    torch.manual_seed(seed)
    initial = mlp(tuple(widths), dtype=dtype).state_dict()

    def trained(name: str, x: torch.Tensor, y: torch.Tensor):
        model = mlp(tuple(widths), dtype=dtype)
        model.load_state_dict(initial)
        trainer = build(name, model, lr=lr)
        for _ in range(steps):
            trainer.step(x, y, nn.functional.mse_loss)
        return trainer

    reference = trained("single", inputs, targets).full_state()
    out: dict = {"world_size": world, "rank": rank, "max_diff": {}, "local_shapes": {}}
    finals = {}
    for name in strategies:
        check_strategy(name)
        trainer = trained(name, inputs[mine], targets[mine])
        finals[name] = trainer.full_state()
        out["max_diff"][name] = _diff(finals[name], reference)
        out["local_shapes"][name] = _local_shapes(trainer)
        dist.barrier()
    if "zero3_hand" in finals and "fsdp2" in finals:
        out["max_diff"]["zero3_hand vs fsdp2"] = _diff(finals["zero3_hand"], finals["fsdp2"])
    return out


def _local_shapes(trainer) -> dict[str, tuple]:
    if trainer.sharded is not None:
        return {s.name: tuple(s.shard.shape) for s in trainer.sharded.shards}
    return {name: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
            for name, p in zip(trainer.names, trainer.model.parameters())}


def check_equivalence(world_sizes: Sequence[int] = (2, 3), tolerance: float = TOLERANCE,
                      strategies: Sequence[str] = SHARDED, timeout: float = 240.0) -> list[dict]:
    """Spawn each world size, run :func:`equivalence`, and assert every difference <= ``tolerance``.

    Returns one row per (world size, comparison) with the largest difference over ranks.
    """
    for world in world_sizes:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world size must be a positive integer, got {world!r}")
        if BATCH % world:
            raise ValueError(f"world size {world} does not divide the batch of {BATCH} samples")
    for name in strategies:
        check_strategy(name)
    rows = []
    for world in world_sizes:
        results = spawn(equivalence, world, tuple(strategies), timeout=timeout, echo=False)
        for name in results[0]["max_diff"]:
            worst = max(r["max_diff"][name] for r in results)
            rows.append({"ranks": world, "compared": name, "largest difference": worst,
                         "within tolerance": worst <= tolerance})
    bad = [r for r in rows if not r["within tolerance"]]
    if bad:
        raise AssertionError(f"differences above {tolerance:g}: {bad}")
    return rows


PHASES = ("forward", "backward", "optimizer.step")


def collectives(strategies: Sequence[str] = SHARDED, fsdp_keep_after_forward: bool = True,
                widths: Sequence[int] = EQUIVALENCE_WIDTHS, seed: int = 0) -> dict[str, dict]:
    """On each rank: the collectives of one training step, per phase, from ``CommDebugMode``.

    The step measured is the third: the first creates the optimizer state and
    DDP rebuilds its buckets at the start of the second (two broadcasts). ``fsdp_keep_after_forward`` adds FSDP2 with
    ``reshard_after_forward=False`` as ``fsdp2 (keep)``.
    """
    _quiet()
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, targets = _data(seed, BATCH, widths, torch.float32)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    cases = [(name, name, True) for name in strategies]
    if fsdp_keep_after_forward:
        cases.append(("fsdp2 (keep)", "fsdp2", False))
    out = {}
    for label, name, reshard in cases:
        torch.manual_seed(seed)
        trainer = build(name, mlp(tuple(widths)), reshard_after_forward=reshard)
        for _ in range(2):
            trainer.step(inputs[mine], targets[mine], nn.functional.mse_loss)
        out[label] = _step_collectives(trainer.model, trainer.optimizer, inputs[mine], targets[mine])
        dist.barrier()
    return out


def _step_collectives(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                      y: torch.Tensor) -> dict[str, dict]:
    """The collectives of one training step, per phase (:data:`PHASES`), from ``CommDebugMode``."""
    counts = {}
    optimizer.zero_grad(set_to_none=True)
    with CommDebugMode() as mode:
        loss = nn.functional.mse_loss(model(x), y)
    counts["forward"] = collective_names(mode.get_comm_counts())
    with CommDebugMode() as mode:
        loss.backward()
    counts["backward"] = collective_names(mode.get_comm_counts())
    with CommDebugMode() as mode:
        optimizer.step()
    counts["optimizer.step"] = collective_names(mode.get_comm_counts())
    return counts


def program_collectives(program: str = PROGRAM, seed: int = 0) -> dict[str, dict]:
    """On each rank: the collectives of one training step of the program's own ZeRO-3.

    The program's ``make_model`` sharded by its ``shard_model``, Adam on its shards, in
    float64 as the program trains, counted per phase as :func:`collectives` counts (the
    third step).
    """
    source = programs.load(program)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = source.make_model().to(worker_device(), torch.float64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    widths = (linears[0].in_features, linears[-1].out_features)
    inputs, targets = _data(seed, BATCH, widths, torch.float64)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    optimizer = torch.optim.Adam([s.shard for s in source.shard_model(model, rank, world)], lr=source.LR)
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
    counts = _step_collectives(model, optimizer, inputs[mine], targets[mine])
    dist.barrier()
    return counts


class _Order(TorchDispatchMode):
    """The order of FSDP2's all-gathers (``AG``) and reduce-scatters (``RS``) and of the layers'
    matrix products (``mm``), with ``F<i>``/``B<i>`` where layer i's forward or backward starts."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        mark = {"_allgather_base_": "AG", "_reduce_scatter_base_": "RS", "mm": "mm", "addmm": "mm"}.get(name)
        if mark:
            self.events.append(mark)
        return func(*args, **(kwargs or {}))


def fsdp2_order(widths: Sequence[int] = (64,) * 5, seed: int = 0) -> dict[str, list[str]]:
    """On each rank: what FSDP2 issues in the forward and backward of the third step, in order
    (:class:`_Order`), on ``fully_shard`` per Linear and on the root."""
    _quiet()
    torch.manual_seed(seed)
    trainer = build("fsdp2", mlp(tuple(widths)))
    x, y = _data(seed, BATCH, widths, torch.float32)
    for _ in range(2):
        trainer.step(x, y, nn.functional.mse_loss)
    order = _Order()
    layers = [m for m in trainer.model.modules() if isinstance(m, nn.Linear)]
    def mark(label: str) -> Callable[..., None]:
        return lambda *_: order.events.append(label)

    hooks = [hook for i, layer in enumerate(layers) for hook in (
        layer.register_forward_pre_hook(mark(f"F{i}")), layer.register_full_backward_pre_hook(mark(f"B{i}")))]
    trainer.optimizer.zero_grad(set_to_none=True)
    with order:
        loss = nn.functional.mse_loss(trainer.model(x), y)
        forward = list(order.events)
        order.events.clear()
        loss.backward()
    for hook in hooks:
        hook.remove()
    dist.barrier()
    return {"forward": forward, "backward": order.events}


class _Tied(nn.Module):
    """Two layers that share one weight (as tied embeddings do)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight


def _error(action) -> tuple[str, str]:
    try:
        action()
    except Exception as exc:  # the message is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def refusals() -> dict[str, tuple[str, str]]:
    """What the hand-written ZeRO-3 and :func:`build` say to models they cannot take."""
    return {
        "shared parameter": _error(lambda: ShardedModel(_Tied())),
        "no parameters": _error(lambda: ShardedModel(nn.Sequential(nn.ReLU()))),
        "unknown strategy": _error(lambda: build("zero4", mlp((2, 2)))),
    }


PARTS: dict[str, Callable[[], object]] = {"equivalence": equivalence, "collectives": collectives,
                                          "memory": measure, "peak": step_peaks, "refusals": refusals,
                                          "program": program_collectives, "order": fsdp2_order}


def check_parts(parts: Sequence[str]) -> list[str]:
    """``parts`` if every name is a part of :data:`PARTS` (call before spawning)."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}; choose from {', '.join(sorted(PARTS))}")
    return list(parts)


def run_parts(parts: Sequence[str]) -> dict:
    """Several parts in one spawn (starting the ranks costs more than the parts)."""
    return {part: PARTS[part]() for part in check_parts(parts)}

