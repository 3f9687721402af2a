"""The one-process replay of a ``ft_train.py`` run's committed steps, from its report: which
groups' batches are in each step, and the sum the groups' collectives compute, bit for bit.
``failures.checks`` compares the run's final weights and checkpoints with it."""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType

import torch


def contributors(report: dict) -> dict[int, list[int]]:
    """Whose batches are in each committed step: the groups that started that step's
    all-reduce in the quorum that committed it. (A group that died after starting it is
    counted when the survivors' all-reduce completed: its gradient is in their average.)"""
    quorum_of = {r["step"]: r["participants"] for r in report["step"] if r["committed"]}
    by: dict[int, set[int]] = defaultdict(set)
    for row in report["contributed"]:
        if quorum_of.get(row["step"]) == row["participants"]:
            by[row["step"]].add(row["group"])
    return {s: sorted(by[s]) for s in sorted(quorum_of)}


def ring_sum(flats: list[torch.Tensor]) -> torch.Tensor:
    """The sum gloo's ring all-reduce computes over ``n`` ranks' flat tensors, bit for bit:
    the tensor is cut into ``n`` chunks of ceil(N / n) elements rounded up to an even number,
    and chunk k is added up starting at rank k + 1, around the ring, ending at rank k. (With
    2 ranks any order gives the same bits; with 3, (g1 + g2) + g0 and (g0 + g1) + g2 differ in
    the last bit.)"""
    n, size = len(flats), flats[0].numel()
    chunk = -(-size // n)
    chunk += chunk % 2
    total = torch.empty_like(flats[0])
    for k in range(n):
        part = slice(k * chunk, min(size, (k + 1) * chunk))
        acc = flats[(k + 1) % n][part].clone()
        for j in range(2, n + 1):
            acc += flats[(k + j) % n][part]
        total[part] = acc
    return total


def _shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """FSDP2's shard ``rank`` of ``t``: rows [rank c, (rank + 1) c), c = ceil(rows / size),
    padded with zero rows to c."""
    rows = -(-t.shape[0] // size)
    part = t[rank * rows:(rank + 1) * rows]
    return torch.cat([part, part.new_zeros((rows - part.shape[0], *t.shape[1:]))])


def sharded_ring_mean(model: torch.nn.Module, group_grads: list[list[torch.Tensor]],
                      size: int) -> list[torch.Tensor]:
    """FT-HSDP across 3 or more groups: FSDP2 hands the hook, for each of its units (here each
    child module with parameters), this rank's reduce-scattered shards of the unit's
    parameters, padded and flattened into one tensor; gloo's ring sums it over the groups
    (``ring_sum``), then the Manager divides by the participants. The full gradients, per
    parameter, put together from the ranks' shards."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    out: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for unit in (m for m in model.children() if any(True for _ in m.parameters())):
        members = [index[id(p)] for p in unit.parameters()]
        shards: dict[int, list[torch.Tensor]] = {i: [] for i in members}
        for rank in range(size):
            flats = [torch.cat([_shard(grads[i], rank, size).flatten() for i in members])
                     for grads in group_grads]
            mean = ring_sum(flats) / len(group_grads)
            rows = [_shard(params[i], rank, size) for i in members]
            for i, piece in zip(members, mean.split([r.numel() for r in rows])):
                shards[i].append(piece.view_as(_shard(params[i], rank, size)))
        for i in members:
            out[i] = torch.cat(shards[i])[:params[i].shape[0]].clone()
    return out


def replay_steps(report: dict, program: ModuleType) -> list[list[torch.Tensor]]:
    """One process, the program's model and batches; the weights after 0, 1, ... steps.

    Each step averages the gradients of the step's contributors as the program's collectives
    do: inside a group, FSDP2 divides each rank's gradient by the group's size before its
    reduce-scatter sums them (in float64 it pre-divides, ``_get_gradient_divide_factors`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); across groups, torchft's
    Manager.allreduce sums (ReduceOp.AVG becomes SUM) and divides by the participants; with
    one rank a group, the sum is gloo's over DDP's one bucket (the parameters in order,
    flattened), added in the ring's order (``ring_sum``); with two, FSDP2's flat shards in the
    ring's order (``sharded_ring_mean``). Then one SGD step."""
    size = report.get("group_size", 1)
    model = program.make_model(report["seed"], report.get("hidden", program.DIMS[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=report["lr"])
    weights = [[p.detach().clone() for p in model.parameters()]]
    for step, groups in contributors(report).items():
        total = [torch.zeros_like(p) for p in model.parameters()]
        grads, group_grads = [], []
        for g in groups:
            group = [torch.zeros_like(p) for p in model.parameters()]
            for rank in range(size):
                model.zero_grad()
                x, y = program.batch(report["seed"], step, g * size + rank)
                ((model(x) - y) ** 2).mean().backward()
                for t, p in zip(group, model.parameters()):
                    t += p.grad / size
            for t, h in zip(total, group):
                t += h
            grads.append(torch.cat([h.flatten() for h in group]))
            group_grads.append(group)
        if len(groups) > 2 and size == 1:   # the order of the sum shows in the last bit
            flat = ring_sum(grads) / len(groups)
            sizes = [p.numel() for p in model.parameters()]
            for t, p in zip(flat.split(sizes), model.parameters()):
                p.grad = t.view_as(p).clone()
        elif len(groups) > 2:
            for p, t in zip(model.parameters(), sharded_ring_mean(model, group_grads, size)):
                p.grad = t
        else:
            for t, p in zip(total, model.parameters()):
                p.grad = t / len(groups)
        optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


def replay(report: dict, program: ModuleType) -> list[torch.Tensor]:
    """The weights after the last committed step of the one-process replay."""
    return replay_steps(report, program)[-1]
