"""Worker functions of the SBP chapter, run on every rank by :func:`ddpguide.launch.spawn`.

Each *part* is a function of this module that returns plain data (tensors come
back to the caller on CPU); :func:`run` runs several parts in one spawn,
because starting the ranks costs more than any part. Usage::

    results = spawn(run, 4, ["sbp_1d", "signature_2d"])
    results[0]["sbp_1d"]        # rank 0's answer
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

from ddpguide.launch.spawn import run_several
from ddpguide.sbp import boxing_by_hand, boxing_rules
from ddpguide.sbp.examples import (
    comm_counts,
    invalid_inputs,
    linear_regression,
    tensor_parallel,
    to_cpu,
)
from ddpguide.sbp.placements import (
    B,
    P,
    S,
    as_placements,
    broadcast_module,
    device_mesh,
    from_local,
    mesh_device,
    placement,
    sbp_name,
    sbp_names,
    to_global,
)
from ddpguide.sbp.regions import local_regions

PARTS: dict[str, Callable[..., Any]] = {}
KINDS_1D = (B, S(0), S(1), P)


def part(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register ``fn`` as a part that :func:`run` can call by name."""
    PARTS[fn.__name__] = fn
    return fn


for _example in (linear_regression, tensor_parallel, invalid_inputs):
    part(_example)


def run(parts: Sequence[str], options: dict[str, dict] | None = None) -> dict[str, Any]:
    """Run the named parts in order on this rank; ``options[name]`` are keyword arguments."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}; choose from {sorted(PARTS)}")
    # DTensor warns once per rank that gloo's S(i)->S(j) falls back to all-gather
    # and that (S, S) -> (B, B) takes two all-gathers; the chapter explains both
    # (with CommDebugMode counts) instead of printing four copies of each warning.
    for name in ("_collective_utils", "_redistribute"):
        logging.getLogger(f"torch.distributed.tensor.{name}").setLevel(logging.ERROR)
    options = options or {}
    return run_several({name: (functools.partial(PARTS[name], **options.get(name, {})),)
                        for name in parts})


@part
def sbp_1d(shape: Sequence[int] = (4, 8)) -> dict:
    """The same logical tensor as B, S(0), S(1) and P on a 1D mesh of all ranks."""
    mesh = device_mesh((dist.get_world_size(),))
    logical = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    locals_ = {}
    for kind in KINDS_1D:
        locals_[sbp_names([kind])] = to_cpu(to_global(logical, mesh, kind).to_local())
    uneven = {}
    for rows in (5, 6):
        t = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
        uneven[rows] = to_cpu(to_global(t, mesh, S(0)).to_local())
    return {"logical": logical, "locals": locals_, "uneven": uneven,
            "device": str(mesh_device(mesh)), "mesh_shape": tuple(mesh.shape)}


@part
def regions_2d(shape: Sequence[int] = (5, 3)) -> dict:
    """Every 2D SBP of one logical tensor on the 2x2 mesh: this rank's piece of each."""
    grid = device_mesh((2, 2))
    logical = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    pieces = {}
    for sbp in itertools.product(KINDS_1D, repeat=2):
        pieces[sbp_names(sbp)] = to_cpu(to_global(logical, grid, sbp).to_local())
    coord = grid.get_coordinate()
    assert coord is not None  # None only for a rank outside the mesh
    return {"logical": logical, "coord": tuple(coord), "pieces": pieces}


# ---------------------------------------------------------------- boxing against DTensor

def _random_source(mesh, shape, placements, seed: int, dtype) -> DTensor:
    """A DTensor whose pieces are arbitrary: random partial summands, random shards.

    Only ranks that must agree (along a B mesh dimension) get the same numbers.
    Small integers in float64 keep every sum exact, so results compare bitwise.
    """
    coord = tuple(mesh.get_coordinate())
    region = local_regions(shape, tuple(mesh.shape), placements)[coord]
    key = seed
    for c, p in zip(coord, placements):
        key = key * 31 + (c + 1 if not isinstance(p, Replicate) else 0)
    gen = torch.Generator().manual_seed(key)
    local = torch.randint(-9, 10, region.shape, generator=gen).to(dtype)
    return from_local(local.to(mesh_device(mesh)), mesh, placements, shape)


def compare_pairs(mesh, shape: Sequence[int], kinds: Sequence = KINDS_1D, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> list[dict]:
    """Hand-written boxing vs ``DTensor.redistribute`` for every (src, dst) pair.

    Placements for an nD mesh are all tuples of ``kinds``. Each record has both
    local results, the collectives each side ran and the bytes we sent.
    """
    specs = list(itertools.product(kinds, repeat=mesh.ndim))
    records = []
    for i, src in enumerate(specs):
        source = _random_source(mesh, shape, src, seed + i, dtype)
        source_full = to_cpu(source.full_tensor())
        for dst in specs:
            theirs, refused = None, None
            with CommDebugMode() as mode:
                try:
                    theirs = to_cpu(source.redistribute(mesh, dst).to_local())
                except RuntimeError as exc:  # DTensor's public API refuses B -> P
                    refused = str(exc)
            with boxing_by_hand.recording() as events:
                mine = boxing_by_hand.redistribute(source.to_local(), mesh, src, dst, shape)
            mine_full = from_local(mine, mesh, dst, shape).full_tensor()
            records.append({
                "shape": tuple(shape), "mesh": tuple(mesh.shape), "device_type": mesh.device_type,
                "src": sbp_names(src),
                "dst": sbp_names(dst), "src_each": [sbp_name(p) for p in src],
                "dst_each": [sbp_name(p) for p in dst],
                "mine": to_cpu(mine), "theirs": theirs, "refused": refused,
                "mine_full": to_cpu(mine_full), "source_full": source_full,
                "mine_comms": [(e.collective, e.mesh_dim, e.bytes_sent) for e in events],
                "theirs_comms": comm_counts(mode),
                "nbytes": torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),
            })
    return records


@part
def boxing_1d(shape: Sequence[int] = (4, 4)) -> list[dict]:
    """Every 1D pair on a mesh of all ranks (the chapter's table)."""
    return compare_pairs(device_mesh((dist.get_world_size(),)), shape)


@part
def boxing_2d(shape: Sequence[int] = (4, 4)) -> list[dict]:
    """Every 2D pair (16 x 16) on the 2x2 mesh."""
    return compare_pairs(device_mesh((2, 2)), shape, seed=1000)


@part
def boxing_all(shapes_1d: Sequence = ((4, 8), (5, 3), (6, 2)),
               shapes_2d: Sequence = ((4, 4), (5, 3))) -> list[dict]:
    """1D over all ranks, 1D over 2 ranks (a row of the 2x2 mesh), and every 2D pair."""
    records = []
    world_mesh = device_mesh((dist.get_world_size(),))
    grid = device_mesh((2, 2), names=("row", "col"))
    for shape in shapes_1d:
        records += compare_pairs(world_mesh, shape)
        records += compare_pairs(grid["col"], shape, seed=100)
    for shape in shapes_2d:
        records += compare_pairs(grid, shape, seed=1000)
    return records


def comparison_rows(records: list[dict], backend: str) -> list[dict]:
    """One table row per record: what we sent, what the formula says, what DTensor did."""
    rows = []
    for r in records:
        src = as_placements(r["src_each"], len(r["mesh"]))
        dst = as_placements(r["dst_each"], len(r["mesh"]))
        steps = boxing_rules.plan(src, dst)
        hand = ", ".join(c for c, _, _ in r["mine_comms"]) or \
            ", ".join(boxing_rules.rule(s.src, s.dst).how for s in steps) or "nothing"
        theirs = ", ".join(f"{k}" + (f" x{v}" if v > 1 else "") for k, v in r["theirs_comms"].items())
        rows.append({
            "from": r["src"], "to": r["dst"], "hand-written": hand,
            "bytes sent per rank": sum(b for _, _, b in r["mine_comms"]),
            f"DTensor ({backend})": "refuses" if r["refused"] else (theirs or "local"),
            "same result": bool(torch.equal(r["mine"], r["theirs"])) if r["theirs"] is not None
            else "-",
            "same logical tensor": bool(torch.equal(r["mine_full"], r["source_full"])),
        })
    return rows


# ---------------------------------------------------------------- 2D SBP

@part
def seed_2d(seed: int = 0) -> dict:
    """The source's 2x2 example: (broadcast, split(0)) for data, broadcast for the model."""
    grid = placement([[0, 1], [2, 3]])
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a_local = to_global(a, grid, (B, S(0))).to_local()
    torch.manual_seed(seed)
    x = torch.randn(2, 2, 8)
    model: nn.Module = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    expected = model(x)
    model = broadcast_module(model.to(mesh_device(grid)), grid)
    global_x = to_global(x, grid, (B, S(0)))
    with CommDebugMode() as mode:
        pred = model(global_x)
    return {"a_local": to_cpu(a_local), "x_local": to_cpu(global_x.to_local()),
            "pred_sbp": sbp_names(pred.placements), "pred": to_cpu(pred.full_tensor()),
            "expected": to_cpu(expected), "forward_comms": comm_counts(mode),
            "device": str(mesh_device(grid))}


@part
def signature_2d(seed: int = 0) -> list[dict]:
    """Matmul SBP signatures found by DTensor's sharding propagation, 1D and 2D."""
    torch.manual_seed(seed)
    x, w = torch.randn(4, 6), torch.randn(6, 8)
    line = device_mesh((dist.get_world_size(),))
    grid = device_mesh((2, 2))
    cases = [(line, (B,), (S(1),)), (line, (S(0),), (B,)), (line, (S(1),), (S(0),)),
             (grid, (B, S(0)), (S(1), B))]
    results = []
    for mesh, x_sbp, w_sbp in cases:
        gx, gw = to_global(x, mesh, x_sbp), to_global(w, mesh, w_sbp)
        with CommDebugMode() as mode:
            y = gx @ gw
        assert isinstance(y, DTensor)  # DTensor @ DTensor
        results.append({"x": sbp_names(x_sbp), "w": sbp_names(w_sbp), "y": sbp_names(y.placements),
                        "comms": comm_counts(mode), "y_full": to_cpu(y.full_tensor()), "expected": x @ w})
    return results


# ---------------------------------------------------------------- training as SBP


# ---------------------------------------------------------------- mistakes


