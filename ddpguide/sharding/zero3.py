"""ZeRO-3 (and ZeRO-2) written by hand with ``torch.distributed``, in SBP terms.

Each rank keeps a flat ``S(0)`` shard of every parameter: the parameter is
flattened, padded with zeros to a multiple of the world size, and rank ``r``
keeps elements ``[r*n, (r+1)*n)``. The optimizer only ever sees the shards.

* before a module's forward: all-gather its parameters (``S(0) -> B``);
* after its forward: free them (ZeRO-3) or keep them (ZeRO-2);
* when the gradient of its output arrives: all-gather them again (ZeRO-3);
* when a parameter's gradient is complete: reduce-scatter it into the shard's
  gradient (``P -> S(0)``, averaged over ranks) and drop the full gradient.

Freeing keeps the parameter object and releases its storage
(``untyped_storage().resize_(0)``), which is what FSDP does: autograd keeps a
reference to the parameter for backward, and the storage is filled again before
backward reads it.

The hooks sit on each module that owns parameters. A module that owns some and
has descendants that own some is one *unit* with all of them (gathered before
its forward, freed after it), because its forward may read a child's
parameter without calling the child, as ``nn.MultiheadAttention`` reads
``out_proj.weight``. A module's output may be a tensor or any tuple, list or
dict of tensors. Shared parameters (tied weights) are refused.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

# torch 2.14 gave the single-tensor collectives new names; older releases have the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardingError(ValueError):
    """A model that this ZeRO-3 cannot shard (the message says why)."""


class ShardedParameter:
    """One parameter of a module, stored as this rank's flat, padded ``S(0)`` shard."""

    def __init__(self, module: nn.Module, attr: str, name: str,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 keep_full: bool = False):
        param = module._parameters[attr]
        assert param is not None, f"{name} is not a parameter"  # attr comes from named_parameters
        self.name = name
        self.group = group
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.numel, self.shape = param.numel(), param.shape
        self.shard_numel = -(-self.numel // self.world)  # ceil: the last shards carry the padding
        # The gather buffer: padded, and the parameter is a view of its first `numel` elements,
        # so an all-gather into it fills the parameter without a copy.
        # A model built on the meta device has no values yet: the shards are allocated on
        # `device` and left for the caller to initialise.
        on_meta = param.device.type == "meta"
        device = device or ("cpu" if on_meta else param.device)
        make = torch.empty if on_meta else torch.zeros  # zeros: the padding must add nothing
        self.full = make(self.shard_numel * self.world, dtype=param.dtype, device=device)
        if not on_meta:
            self.full[: self.numel] = param.detach().reshape(-1)
        piece = self.full[rank * self.shard_numel:(rank + 1) * self.shard_numel]
        # ZeRO-2 keeps the full parameter, so the shard can be this rank's piece of it (no
        # second copy, and the all-gather runs in place). ZeRO-3 frees the full parameter,
        # so its shard needs memory of its own.
        self.keep_full = keep_full
        self.shard = nn.Parameter(piece if keep_full else piece.clone(),
                                  requires_grad=param.requires_grad)
        if on_meta:  # a real parameter in its place (a meta tensor cannot take CPU data)
            param = nn.Parameter(torch.empty(0, dtype=param.dtype, device=device),
                                 requires_grad=param.requires_grad)
            module._parameters[attr] = param
        # `.data =` keeps the parameter's own autograd identity (and version counter), so
        # refilling the buffer before backward does not count as an in-place change of it.
        param.data = self.full[: self.numel].view(self.shape)
        self.param = param  # stays registered in the module; its storage comes and goes
        if not keep_full:
            self.free()

    @property
    def gathered(self) -> bool:
        """Whether the full parameter is in memory now."""
        return self.full.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """``S(0) -> B``: all-gather the shards into the full parameter."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full.numel() * self.full.element_size())
        _all_gather(self.full, self.shard.detach(), group=self.group)

    def free(self) -> None:
        """Release the full parameter's memory (ZeRO-3; the shard has its own)."""
        self.full.untyped_storage().resize_(0)

    def reduce_gradient(self) -> None:
        """``P -> S(0)``: average the full gradients of all ranks into this shard's gradient."""
        grad = self.param.grad
        assert grad is not None, f"{self.name} has no gradient to reduce"  # called once it is accumulated
        if self.numel == self.full.numel():
            flat = grad.reshape(-1)  # nothing to pad: no copy
        else:
            flat = torch.zeros(self.full.numel(), dtype=grad.dtype, device=grad.device)
            flat[: self.numel] = grad.reshape(-1)
        shard_grad = torch.empty_like(self.shard)
        # SUM then divide: every backend has SUM (gloo's AVG is recent).
        _reduce_scatter(shard_grad, flat, op=dist.ReduceOp.SUM, group=self.group)
        shard_grad.div_(self.world)
        if self.shard.grad is None:
            self.shard.grad = shard_grad
        else:  # gradient accumulation over several backward passes
            self.shard.grad += shard_grad
        self.param.grad = None
        if not self.keep_full:
            self.free()


class ShardedModel:
    """The hooks that make a plain ``nn.Module`` train with sharded parameters.

    ``free_after_use=True`` is ZeRO-3 (parameters, gradients and optimizer state
    sharded); ``False`` is ZeRO-2: full parameters stay on every rank and are
    refreshed by the all-gather before each forward. A model built on the meta
    device gets its shards on ``device`` (default CPU), uninitialised.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None,
                 free_after_use: bool = True, device: torch.device | str | None = None):
        _check_shardable(model)
        self.model = model
        self.free_after_use = free_after_use
        self.shards: list[ShardedParameter] = []
        self._handles: list[RemovableHandle] = []
        for module_name, module in _units(model):
            # A module that owns parameters and has descendants that own some is one unit
            # with all of them: its forward may read a child's parameter without calling the
            # child (nn.MultiheadAttention reads out_proj.weight), as FSDP's units allow.
            owners = module.named_modules(prefix=module_name) if _is_unit(module) else [(module_name, module)]
            own = [ShardedParameter(owner, name, _join(owner_name, name), group, device,
                                    keep_full=not free_after_use)
                   for owner_name, owner in owners
                   for name, _ in list(owner.named_parameters(recurse=False))]
            if own:
                self.shards += own
                self._hook(module, own)

    def _hook(self, module: nn.Module, own: list[ShardedParameter]) -> None:
        free = self.free_after_use

        def before_forward(_module, _args):
            for s in own:
                s.gather()

        def after_forward(_module, _args, output):
            if not free:
                return
            for s in own:
                s.free()
            # Fires when the first gradient of this module's outputs (a tensor, or every
            # tensor of a tuple, list or dict) is ready, before its backward reads them.
            needing = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing:
                register_multi_grad_hook(needing, lambda _grads: _gather_all(own), mode="any")

        self._handles.append(module.register_forward_pre_hook(before_forward))
        self._handles.append(module.register_forward_hook(after_forward))
        for s in own:
            if s.param.requires_grad:
                self._handles.append(s.param.register_post_accumulate_grad_hook(
                    lambda _p, s=s: s.reduce_gradient()))

    def parameters(self) -> list[nn.Parameter]:
        """The shards: what the optimizer updates."""
        return [s.shard for s in self.shards]

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name, gathered (a collective: call it on every rank)."""
        out = {}
        for s in self.shards:
            was_gathered = s.gathered
            s.gather()
            out[s.name] = s.param.detach().clone()
            if not was_gathered:
                s.free()
        return out

    def remove(self) -> None:
        """Remove the hooks (the parameters stay sharded)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _gather_all(own: Iterable[ShardedParameter]) -> None:
    for s in own:
        s.gather()


def _is_unit(module: nn.Module) -> bool:
    """Whether ``module`` owns parameters and so do some of its descendants."""
    return (next(module.parameters(recurse=False), None) is not None
            and any(next(m.parameters(recurse=False), None) is not None
                    for m in list(module.modules())[1:]))


def _units(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The modules to hook, outermost first; a unit's descendants are not hooked on their own."""
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if _is_unit(module):
            inside.update(id(m) for m in module.modules())
        yield name, module


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_shardable(model: nn.Module) -> None:
    """Refuse, with one clear line, what the per-module hooks cannot handle: a parameter
    shared by two modules, a parameter that is not floating point, a model without any."""
    if not dist.is_initialized():
        raise ShardingError("ZeRO-3 needs a process group: call dist.init_process_group first")
    owners: dict[int, str] = {}
    count = 0
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            count += 1
            where = _join(module_name, name)
            if id(p) in owners and owners[id(p)] != where:
                raise ShardingError(
                    f"parameter {where!r} is the same tensor as {owners[id(p)]!r}: shared "
                    "parameters cannot be sharded module by module")
            owners[id(p)] = where
            if not p.is_floating_point():
                raise ShardingError(f"parameter {where!r} has dtype {p.dtype}: only floating-point "
                                    "parameters can be sharded")
    if count == 0:
        raise ShardingError(f"the model ({type(model).__name__}) has no parameters to shard")
