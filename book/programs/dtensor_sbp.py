"""SBP on PyTorch's DTensor: split, broadcast and partial as Shard, Replicate and Partial.

OneFlow's SBP describes how one logical tensor lies on a group of devices: split
(each device holds a slice), broadcast (each holds all of it) or partial (each holds a
summand, and the logical tensor is their sum). PyTorch's DTensor has the same three
placements on a DeviceMesh: Shard(dim), Replicate() and Partial(). Changing placement
("boxing") costs one collective, which CommDebugMode counts here:

  Shard -> Replicate     all-gather        Partial -> Replicate   all-reduce
  Partial -> Shard       reduce-scatter    Shard(0) -> Shard(1)   all-to-all

(DTensor takes no all-to-all path on a CPU mesh, although gloo has all-to-all:
S(0) -> S(1) warns and all-gathers instead.)

A matrix product x @ w with x split along its columns and w along its rows gives each
rank a summand of the result: the placement Partial, with no communication at all.
On a 2x2 mesh a tensor has one placement per mesh dimension: (Shard(0), Shard(1))
cuts an 8x4 matrix into four 4x2 blocks; (Replicate(), Shard(0)) is the source's
(broadcast, split(0)). Every rank reports one line per step, prefixed with its rank
(rank 0 collects the lines, so they come in rank order), and full_tensor() is checked
against the original each time.

Run:  torchrun --standalone --nproc-per-node=4 dtensor_sbp.py

From the source (the OneFlow book's SBP chapter), in PyTorch terms: placement ->
DeviceMesh, sbp -> placements, to_global -> distribute_tensor, to_local -> to_local.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

WORLD_SIZE = 4  # the 2x2 mesh needs exactly four ranks


def collectives(action) -> tuple:
    """Run ``action()`` and return (its result, the names of the collectives it issued)."""
    with CommDebugMode() as comm:
        result = action()
    names = sorted(str(op).split(".")[-1] for op in comm.get_comm_counts())
    return result, ", ".join(names) or "none"


def rank_device() -> torch.device:
    """This rank's GPU, or the CPU where ranks would have to share one (nccl refuses that).

    GPU LOCAL_RANK when this machine shows one per local rank; cuda:0 when the launcher
    left this rank exactly one (CUDA_VISIBLE_DEVICES names one device: srun --gpus-per-task=1,
    torchrun --virtual-local-rank). A torchrun worker other than local rank 0 that sees one
    listed GPU shares it (torchrun passes its CUDA_VISIBLE_DEVICES to every worker
    unchanged): refused in one line, since rank 0 takes that GPU with nccl.
    """
    gpus = torch.cuda.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus >= local_ranks:
        return torch.device("cuda", local_rank)
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if gpus == 1 and len(visible) == 1:
        if local_rank > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            print(f"{gpus} GPU visible to every one of {local_ranks} local ranks: nccl needs a GPU "
                  "of its own for each rank (run one rank per GPU, give each its own with torchrun "
                  "--virtual-local-rank, or hide it with CUDA_VISIBLE_DEVICES= to run on the CPU)",
                  file=sys.stderr, flush=True)
            raise SystemExit(2)
        return torch.device("cuda", 0)
    return torch.device("cpu")


TIMEOUT = timedelta(seconds=60)  # every collective of every group gives up after this


def mesh_2d(device_type, names):
    """A 2x2 mesh. It makes one process group per mesh dimension; without these options they
    would get c10d's default timeout, not TIMEOUT (30 minutes on gloo, 10 on nccl)."""
    nccl = dist.get_backend() == "nccl"
    options = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo.Options("gloo")
    options._timeout = TIMEOUT
    return init_device_mesh(device_type, (2, 2), mesh_dim_names=names,
                            backend_override=dict.fromkeys(names, options))


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device().type
    if device == "cuda":
        torch.cuda.set_device(rank_device())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=TIMEOUT)
    failures = []

    def show(step: str, expected: torch.Tensor, tensor: DTensor, comm: str = ""):
        """Check full_tensor() (itself a collective); rank 0 prints every rank's line in order."""
        ok = torch.equal(tensor.full_tensor().cpu(), expected)
        failures.extend([] if ok else [step])
        line = (f"  [rank {rank}] mesh coordinate {tensor.device_mesh.get_coordinate()}, "
                f"local shape {tuple(tensor.to_local().shape)} starting with "
                f"{tensor.to_local().flatten()[0].item():g}, full_tensor() right: {ok}")
        lines = [None] * world_size if rank == 0 else None
        dist.gather_object(line, lines, dst=0)
        if rank == 0:
            print(f"{step}: {tensor.placements}" + (f", collectives: {comm}" if comm else ""))
            print("\n".join(lines), flush=True)

    mesh = init_device_mesh(device, (world_size,))
    # The same 8x4 matrix everywhere (distribute_tensor sends rank 0's to be sure).
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    s0 = distribute_tensor(full, mesh, [Shard(0)])
    show("distribute Shard(0)", full, s0)
    show("distribute Replicate()", full, distribute_tensor(full, mesh, [Replicate()]))
    show("distribute Partial() (full / 4 each)", full, distribute_tensor(full, mesh, [Partial()]))
    show("S(0) -> S(1)", full, *collectives(lambda: s0.redistribute(mesh, [Shard(1)])))
    show("S(0) -> R", full, *collectives(lambda: s0.redistribute(mesh, [Replicate()])))

    # S(1) @ S(0) = P: each rank multiplies its column of x by its row of w.
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) - 10
    x_cols = distribute_tensor(full, mesh, [Shard(1)])
    w_rows = distribute_tensor(w, mesh, [Shard(0)])
    product, comm = collectives(lambda: x_cols @ w_rows)
    show("x S(1) @ w S(0)", full @ w, product, comm)
    show("P -> R", full @ w, *collectives(lambda: product.redistribute(mesh, [Replicate()])))
    show("P -> S(0)", full @ w, *collectives(lambda: product.redistribute(mesh, [Shard(0)])))

    mesh2d = mesh_2d(device, ("rows", "cols"))
    blocks = distribute_tensor(full, mesh2d, [Shard(0), Shard(1)])
    show("2x2 mesh, distribute (S(0), S(1))", full, blocks)
    show("2x2 mesh, distribute (R, S(0))", full,
         distribute_tensor(full, mesh2d, [Replicate(), Shard(0)]))
    show("(S(0), S(1)) -> (R, R)", full,
         *collectives(lambda: blocks.redistribute(mesh2d, [Replicate(), Replicate()])))

    failed = torch.tensor([len(failures)], device=device)
    dist.all_reduce(failed)  # every rank learns whether any check failed
    if rank == 0:
        print("all checks passed" if failed.item() == 0 else "SOME CHECKS FAILED", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if failed.item() == 0 else 1)


def check_launch():
    """Exit with one line on stderr (status 2) unless torchrun started four ranks."""
    if os.environ.get("WORLD_SIZE") != str(WORLD_SIZE) or "LOCAL_RANK" not in os.environ:
        print(f"dtensor_sbp.py: error: needs {WORLD_SIZE} ranks (WORLD_SIZE="
              f"{os.environ.get('WORLD_SIZE')}): start me with "
              "torchrun --standalone --nproc-per-node=4 dtensor_sbp.py", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_launch()
    main()
