"""Tensor parallelism with ``parallelize_module``: a plan check, and checks against one process.

The chapter's program (``book/programs/tensor_parallel.py``) teaches the idea;
this module imports that program and runs its three cases (its modules and its
plans, :func:`cases`) as worker functions that return data:

* a Megatron-style MLP: ``up`` column-parallel, GELU, ``down`` row-parallel;
* an attention block: ``q``, ``k``, ``v`` column-parallel (whole heads per
  rank), ``out`` row-parallel;
* sequence parallelism: a LayerNorm on a slice of the sequence, then the MLP,
  which all-gathers the sequence on the way in and reduce-scatters it out.

Each worker runs the plain module (what one process computes) next to the
parallel one, in float64, and reports the largest difference over every rank;
the tests assert it is at most :data:`TOLERANCE`.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from ddpguide.core.mesh import device_mesh, mesh_device
from ddpguide.launch import programs
from ddpguide.sbp.boxing_by_hand import collective_names

TOLERANCE = 1e-12  # float64: the differences are rounding (about 1e-15)


#: The chapter's program: its modules and plans are the ones checked here (no copy).
PROGRAM = "tensor_parallel.py"


def cases(program: str = PROGRAM) -> dict[str, tuple]:
    """The program's cases, by name: ``(title, module class, plan, split input dim or None)``.

    Read from the program itself (:func:`ddpguide.launch.programs.load`), so a
    changed plan in the program is a changed check and a changed table.
    """
    return programs.load(program).cases()


def _matches(name: str, key: str) -> bool:
    """``parallelize_module``'s rule: each dotted part of the key is an fnmatch pattern."""
    parts, tokens = name.split("."), key.split(".")
    return len(parts) == len(tokens) and all(fnmatch(p, t) for p, t in zip(parts, tokens))


def check_plan(model: nn.Module, plan: dict[str, Any]) -> None:
    """Raise ``ValueError`` if a plan entry names no submodule of ``model``.

    ``parallelize_module`` only warns and skips such an entry, so a typo leaves
    a layer unsplit (and silently replicated) instead of failing.
    """
    names = [name for name, _ in model.named_modules() if name]
    for key in plan:
        if key and not any(_matches(name, key) for name in names):
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"tensor-parallel plan entry {key!r} names no submodule of "
                             f"{type(model).__name__} (its submodules: {shown})")


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """``parallelize_module`` after :func:`check_plan` (a 1-D mesh: slice a 2-D one first)."""
    check_plan(model, plan)
    return parallelize_module(model, mesh, plan)


def _placements(value: Any) -> str:
    return str(tuple(value.placements)) if isinstance(value, DTensor) else "plain tensor"


def _watch(model: nn.Module, plan: dict) -> dict[str, dict]:
    """Forward hooks registered *before* parallelize_module: they see each planned
    submodule's input as its style prepared it and its output before the style's
    output hook changes it."""
    seen: dict[str, dict] = {}
    for name in plan:
        def record(module, inputs, output, name=name):  # returns None: nothing changes
            seen.setdefault(name, {"input": _placements(inputs[0]), "computes": _placements(output)})
        model.get_submodule(name).register_forward_hook(record)
    return seen


def compare_with_one_process(case: str = "mlp", seed: int = 0, program: str = PROGRAM) -> dict:
    """Worker: the program's ``case`` parallelized over all ranks vs the plain module, float64.

    Returns the largest difference (output, input gradient, every parameter
    gradient) over every rank, a placement table and the collectives that
    ``CommDebugMode`` saw in one forward and one backward.
    """
    source = programs.load(program)
    _, make, plan, split_dim = source.cases()[case]
    mesh = device_mesh((dist.get_world_size(),))
    device = mesh_device(mesh)
    torch.manual_seed(seed)
    plain = make().to(device, torch.float64)
    split = make().to(device, torch.float64)
    split.load_state_dict(plain.state_dict())
    seen = _watch(split, plan)
    parallelize(split, mesh, plan)

    torch.manual_seed(seed + 1)
    x = torch.randn(source.BATCH, source.SEQ, source.DIM, dtype=torch.float64, device=device)
    x_plain = x.clone().requires_grad_(True)
    expected = plain(x_plain)
    expected.pow(2).sum().backward()

    def mine(t: torch.Tensor) -> torch.Tensor:  # this rank's slice under sequence parallelism
        return t if split_dim is None else t.chunk(mesh.size(), split_dim)[mesh.get_local_rank()]

    x_mine = mine(x).clone().requires_grad_(True)
    with CommDebugMode() as forward:
        out = split(x_mine)
    with CommDebugMode() as backward:
        out.pow(2).sum().backward()

    assert x_mine.grad is not None and x_plain.grad is not None  # both had a backward
    differences = [(out - mine(expected)).abs().max().item(),
                   (x_mine.grad - mine(x_plain.grad)).abs().max().item()]
    plain_params = dict(plain.named_parameters())
    rows = []
    for name, p in split.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        differences.append((grad - plain_params[name].grad).abs().max().item())
        rows.append({"tensor": name, "placements": _placements(p),
                     "local shape": tuple((p.to_local() if isinstance(p, DTensor) else p).shape),
                     "global shape": tuple(p.shape),
                     "gradient": _placements(p.grad)})
    worst = torch.tensor(max(differences), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    activations = [{"module": name, "input": s["input"], "computes": s["computes"],
                    "hands on": str(getattr(plan[name], "output_layouts",
                                            getattr(plan[name], "sequence_sharding", "")))}
                   for name, s in seen.items()]
    return {"case": case, "program": program, "world": mesh.size(), "max_difference": worst.item(),
            "parameters": rows, "activations": activations,
            "forward_comms": collective_names(forward.get_comm_counts()),
            "backward_comms": collective_names(backward.get_comm_counts())}


def compare_all(program: str = PROGRAM, seed: int = 0) -> dict[str, dict]:
    """Worker: :func:`compare_with_one_process` for every case of ``program``, by name."""
    return {case: compare_with_one_process(case, seed, program) for case in cases(program)}


def typo_in_plan(key: str = "dwn", program: str = PROGRAM) -> dict[str, Any]:
    """Worker: a plan entry naming no submodule, given to ``parallelize_module`` and to ours.

    Returns what each said, and whether ``parallelize_module`` left ``down``
    as a plain (unsplit) layer. The layer is the program's ``MLP``.
    """
    MLP = programs.load(program).MLP
    mesh = device_mesh((dist.get_world_size(),))
    plan = {"up": ColwiseParallel(), key: RowwiseParallel()}
    model = MLP().to(mesh_device(mesh))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(model, mesh, plan)
    try:
        parallelize(MLP().to(mesh_device(mesh)), mesh, plan)
        ours = "no error"
    except ValueError as exc:
        ours = f"ValueError: {exc}"
    return {"parallelize_module": [str(w.message) for w in caught if "plan key" in str(w.message)],
            "down_is_plain": not isinstance(model.down.weight, DTensor), "ours": ours}
