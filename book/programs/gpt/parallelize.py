"""Put the GPT of model.py on a layout: pipeline, tensor (and sequence), context,
expert and data parallelism, in that order. torch only.

The order is torchtitan's: cut the pipeline first (each stage is a model of its own,
parallelised alone); then tensor parallelism, which turns weights into DTensors sharded
over "tp"; then activation checkpointing and compilation, which wrap whole blocks; FSDP
last, because it shards whatever each parameter has become (a TP shard is sharded again
over the data-parallel ranks) and puts its all-gathers around the wrapped blocks.
"""

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")  # outermost first


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1  # experts spread over ep ranks; they are data-parallel for everything else
    tp: int = 1

    @property
    def world(self):
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.ep * self.tp

    @property
    def data_parallel(self):
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard * self.ep

    def name(self):
        parts = [f"{axis.upper().replace('DP_', '')} {getattr(self, axis)}"
                 for axis in AXES if getattr(self, axis) > 1]
        return " x ".join(parts) or "1 process"


def problems(layout: Layout, config, world: int, microbatches: int, batch: int):
    """Everything wrong with running this layout on this many ranks (empty: all is well)."""
    found = []
    if layout.world != world:
        found.append(f"the layout {layout.name()} needs {layout.world} ranks, not {world}")
    if config.heads % layout.tp:
        found.append(f"--tp {layout.tp} does not divide the {config.heads} heads")
    elif (config.kv_heads or config.heads) % layout.tp:
        found.append(f"--tp {layout.tp} does not divide the {config.kv_heads} key/value heads")
    if config.layers % layout.pp:
        found.append(f"--pp {layout.pp} does not divide the {config.layers} layers")
    if config.seq % (layout.cp * layout.tp):
        found.append(f"--cp {layout.cp} x --tp {layout.tp} does not divide the sequence "
                     f"of {config.seq} tokens")
    elif layout.cp > 1 and config.seq % (2 * layout.cp):
        found.append(f"--cp {layout.cp}: the zig-zag split needs 2 x {layout.cp} chunks of "
                     f"equal length, not of a sequence of {config.seq} tokens")
    if layout.ep > 1 and not config.experts:
        found.append(f"--ep {layout.ep} needs experts (--experts)")
    if config.experts and config.experts % layout.ep:
        found.append(f"--ep {layout.ep} does not divide the {config.experts} experts")
    if config.experts and layout.tp > 1:
        found.append("--tp with --experts: this program shards experts by --ep only")
    if batch % (layout.data_parallel * microbatches):
        found.append(f"--batch {batch} does not split into {layout.data_parallel} data-parallel "
                     f"ranks x {microbatches} micro-batches")
    return found


def group_options(timeout):
    """Options that give a new process group this timeout. DeviceMesh creates one group per
    dimension and passes no timeout of its own: without them every group would get c10d's
    default (30 minutes on gloo, 10 on nccl), not the job's."""
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return dist.ProcessGroupGloo.Options("gloo", timeout)


def build_mesh(layout: Layout, device_type: str, timeout):
    """The meshes by name: the six axes (size-1 ones too) and the flattened ones FSDP uses,
    every group with the job's timeout.

    A size-1 axis still gets a process group of one rank, which this program never gives
    a collective: torch 2.14.1 would leave it without one (backend_override "fake", as
    torchtitan does) only after an import of its test helpers
    (torch.testing._internal.distributed.fake_pg registers that backend).
    """
    options = group_options(timeout)
    world = init_device_mesh(device_type, [getattr(layout, a) for a in AXES], mesh_dim_names=AXES,
                             backend_override=dict.fromkeys(AXES, options))
    meshes = {axis: world[axis] for axis in AXES}
    meshes["world"] = world

    def flat(axes, name):
        return world[axes]._flatten(name, backend_override=options)

    meshes["fsdp"] = flat(("dp_shard", "cp", "ep"), "fsdp")  # the dense weights' shards
    meshes["efsdp"] = flat(("dp_shard", "cp"), "efsdp")  # experts' (ep splits them too)
    meshes["loss"] = flat(("dp_replicate", "dp_shard", "cp", "ep"), "loss")  # averaged over
    if layout.dp_replicate > 1:  # HSDP: a 2-D mesh (replicas, shards) of the same ranks
        shards = layout.dp_shard * layout.cp * layout.ep
        meshes["hsdp"] = meshes["loss"]._unflatten(
            0, (layout.dp_replicate, shards), ("replica", "shard"),
            backend_override=dict.fromkeys(("replica", "shard"), options))
        meshes["ehsdp"] = flat(("dp_replicate", "dp_shard", "cp"), "edp")._unflatten(
            0, (layout.dp_replicate, layout.dp_shard * layout.cp), ("ereplica", "eshard"),
            backend_override=dict.fromkeys(("ereplica", "eshard"), options))
    return meshes


def uses_fsdp(layout: Layout, bf16=False):
    """FSDP2 where weights are sharded, where replicas meet TP or PP (HSDP), and with bf16;
    DDP for replicas alone."""
    sharded = layout.dp_shard * layout.cp * layout.ep > 1
    return sharded or bf16 or (layout.dp_replicate > 1 and (layout.tp > 1 or layout.pp > 1))


def pipeline_stage(model, layout: Layout, pp_rank: int):
    """This rank's stage: its layers, the embedding on the first, norm and head on the last.

    The last stage keeps the embedding too, for its weight (tied to the head's); the two
    copies get the same gradient (tie_gradients) and so stay equal.
    """
    if layout.pp == 1:
        return model
    per = model.config.layers // layout.pp
    stage = copy.deepcopy(model)
    mine = range(pp_rank * per, (pp_rank + 1) * per)
    stage.layers = torch.nn.ModuleDict({k: v for k, v in stage.layers.items() if int(k) in mine})
    stage.embeds, stage.outputs = pp_rank == 0, pp_rank == layout.pp - 1
    if not (stage.embeds or stage.outputs):
        stage.tok_emb = None
    if not stage.outputs:
        stage.norm = stage.head = None
    return stage


def apply_tp(model, tp_mesh, sequence_parallel=True):
    """Megatron's column/row split of every block; with sequence_parallel, the norms and the
    residual stream split along the sequence (SP), so each all-reduce becomes a
    reduce-scatter after the block's row-split layer and an all-gather before its column split.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else None
    top = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": norm,
        "head": PrepareModuleInput(input_layouts=(seq, Shard(0)),
                                   desired_input_layouts=(Replicate(), Shard(0))),
    }
    plan = {name: style for name, style in top.items()
            if style is not None and getattr(model, name, None) is not None}
    parallelize_module(model, tp_mesh, plan)
    # the logits stay vocabulary-sharded, a DTensor: train.py computes the loss under
    # loss_parallel, which never gathers them (each rank holds 1/tp of them)
    for block in model.layers.values():
        plan = {
            "attn_norm": norm,
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "mlp_norm": norm,
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=seq),
        }
        parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if v is not None})


def apply_ep(model, ep_mesh):
    """Keep this rank's E / ep experts; route tokens over the "ep" group."""
    rank, ranks = ep_mesh.get_local_rank(), ep_mesh.size()
    for block in model.layers.values():
        experts = block.mlp.experts
        local = block.mlp.n_experts // ranks
        for name in ("w1", "w2"):
            full = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))
        block.mlp.ep_group = ep_mesh.get_group()


def apply_ac(model):
    """Recompute each block's activations in the backward pass instead of keeping them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model, mesh, layout: Layout, in_pipeline: bool, bf16=False):
    """FSDP2 over every data-parallel rank (HSDP: replicated over dp_replicate).

    With bf16, FSDP2's mixed precision: each group's parameters are gathered in bfloat16
    (half the bytes) and computed with, and the gradients reduced in float32 into the
    float32 shards AdamW updates. The router keeps float32 (a group of its own).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dense = mesh["hsdp"] if layout.dp_replicate > 1 else mesh["fsdp"]
    reshard = not in_pipeline  # a pipeline runs each block once per micro-batch: keep it gathered
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 else None)
    for block in model.layers.values():
        moe = getattr(block, "mlp", None)
        if bf16 and hasattr(moe, "router"):
            fully_shard(moe.router, mesh=dense, reshard_after_forward=reshard,
                        mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        if layout.ep > 1 and hasattr(moe, "experts"):
            experts = mesh["ehsdp"] if layout.dp_replicate > 1 else mesh["efsdp"]
            fully_shard(moe.experts, mesh=experts, reshard_after_forward=reshard, mp_policy=policy)
            # FSDP averages each expert's gradient over the ranks it reduces over, but the
            # all-to-all's backward has already summed it over the "ep" ranks: divide by ep
            # too. (Not set_gradient_divide_factor: on a mesh of one rank torch 2.14 divides
            # float64 gradients twice by it, and on gloo float32 needs PREMUL_SUM.)
            moe.experts.set_all_reduce_hook(lambda grad, ep=layout.ep: grad.div_(ep))
        fully_shard(block, mesh=dense, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dense, reshard_after_forward=reshard, mp_policy=policy)


def parallelize(model, layout: Layout, mesh, device, checkpoint=False, compile=False, bf16=False):
    """This rank's part of the model on the layout (before any optimizer is built).

    With bf16, FSDP2 holds the parameters on every layout (on a mesh of one rank it shards
    nothing, but it casts them)."""
    stage = pipeline_stage(model, layout, mesh["pp"].get_local_rank()).to(device)
    if layout.tp > 1:
        apply_tp(stage, mesh["tp"])
    if layout.cp > 1:
        for block in stage.layers.values():
            block.attn.cp_group = mesh["cp"].get_group()
            if hasattr(block.mlp, "experts"):  # the load-balancing loss counts whole sequences
                block.mlp.cp_group = mesh["cp"].get_group()
    if layout.ep > 1:
        apply_ep(stage, mesh["ep"])
    if checkpoint:
        apply_ac(stage)
    if compile:
        for name, block in list(stage.layers.items()):
            stage.layers[name] = torch.compile(block)
    if uses_fsdp(layout, bf16):
        apply_fsdp(stage, mesh, layout, in_pipeline=layout.pp > 1, bf16=bf16)
    elif layout.dp_replicate > 1:
        stage = torch.nn.parallel.DistributedDataParallel(
            stage, process_group=mesh["dp_replicate"].get_group())
    return stage


def tie_groups(mesh, layout: Layout, timeout):
    """For each pipeline, the group of its first and last stage (which both hold the embedding)."""
    if layout.pp == 1:
        return None
    me = dist.get_rank()
    rows = mesh["world"].mesh.reshape(layout.pp, -1).t().tolist()  # one row per pipeline: its pp ranks
    mine = None
    for row in rows:  # every rank creates every group, in the same order
        group = dist.new_group([row[0], row[-1]], timeout=timeout)
        if me in (row[0], row[-1]):
            mine = group
    return mine


def tie_gradients(stage, group):
    """Sum the embedding's gradient of the first stage (lookups) and the last (logits)."""
    if group is None or stage.tok_emb is None:
        return
    weight = stage.tok_emb.weight
    grad = weight.grad
    if hasattr(grad, "placements") and grad.placements != weight.placements:
        # under TP the lookup's gradient comes back replicated: take this rank's rows of it
        grad = weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
    dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


def sum_partial_gradients(stage):
    """Sequence parallelism leaves the norms' gradients as partial sums over "tp" (each rank
    saw its part of the sequence). FSDP2 sums them before it reduce-scatters; without FSDP
    they are summed here, once (DTensor would otherwise sum them again inside every
    operation of the optimizer that reads them)."""
    for p in stage.parameters():
        grad = p.grad
        if grad is not None and any(pl.is_partial() for pl in getattr(grad, "placements", ())):
            p.grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                   for pl in grad.placements])
