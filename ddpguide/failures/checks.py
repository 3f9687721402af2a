"""What must hold after a run of ``ft_train.py`` with failures injected, read from its report.

Every check returns a list of problems (empty when it holds), so that a chapter cell, a
test and the chaos test assert the same thing. The report's rows, each with its group and
its rank in the group:

- ``step``: one per step a rank ran: step, quorum id, participants, committed, weights
  (a digest of the bytes of the rank's parameters, its shards under FSDP2, after the step);
- ``contributed``: written just before a rank's backward (its all-reduces): step, quorum:
  whose batch can be inside that step's average;
- ``killed`` / ``healed``: a process exiting on purpose; a rank loading a peer's state;
- ``checkpoint``: a group's checkpoint made complete (renamed) after a step;
- ``final``: every rank's full parameters when it reached the last step.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import torch


def committed_together(report: dict) -> list[str]:
    """In every quorum, a step is committed by every rank of every group that ran it, or by none."""
    votes: dict[tuple[int, int], set[bool]] = defaultdict(set)
    for row in report["step"]:
        votes[(row["step"], row["quorum"])].add(row["committed"])
    return [f"step {s} in quorum {q}: some groups committed, some did not"
            for (s, q), v in sorted(votes.items()) if len(v) > 1]


def equal_after_commit(report: dict) -> list[str]:
    """After every committed step, the same rank of every group that committed it holds the same
    weights (its shard of them, under FSDP2)."""
    digests: dict[tuple[int, int], set[str]] = defaultdict(set)
    for row in report["step"]:
        if row["committed"]:
            digests[(row["step"], row["rank"])].add(row["weights"])
    return [f"step {s} rank {r}: {len(d)} different weights" for (s, r), d in sorted(digests.items())
            if len(d) > 1]


def steps_counted(report: dict) -> dict:
    """Each step committed by some group (none lost) and by no rank twice (none repeated).

    A group that heals at step h takes steps 0..h-1 from its peer, so its own commits plus
    the steps it received cover 0..steps-1 exactly once."""
    steps = report["steps"]
    per_rank: dict[tuple[int, int], list[int]] = defaultdict(list)
    for row in sorted(report["step"], key=lambda r: r["time"]):
        if row["committed"]:
            per_rank[(row["group"], row["rank"])].append(row["step"])
    committed = {s for ss in per_rank.values() for s in ss}
    twice = {f"{g}.{r}": sorted({s for s in ss if ss.count(s) > 1})
             for (g, r), ss in per_rank.items()}
    final_steps = {f"{r['group']}.{r['rank']}": r["step"] for r in report["final"]}
    everyone = [f"{g}.{r}" for g in report.get("local_groups", range(report["groups"]))
                for r in range(report.get("group_size", 1))]
    return {"lost": sorted(set(range(steps)) - committed),
            "applied_twice": {k: t for k, t in twice.items() if t},
            "final_steps": final_steps,
            "ok": committed == set(range(steps)) and not any(twice.values())
            and sorted(final_steps) == sorted(everyone) and set(final_steps.values()) == {steps}}


def heals_match_donor(report: dict) -> list[str]:
    """A rank that heals at step h holds, bitwise, the weights the same rank of its peers
    committed at h-1."""
    problems = []
    after: dict[tuple[int, int], set[str]] = defaultdict(set)
    for row in report["step"]:
        if row["committed"]:
            after[(row["step"] + 1, row["rank"])].add(row["weights"])
    for heal in report["healed"]:
        donor = after.get((heal["step"], heal["rank"]), set()) if heal["step"] > 0 else set()
        if heal["weights"] not in donor:
            problems.append(f"group {heal['group']} rank {heal['rank']} healed at step "
                            f"{heal['step']} to {heal['weights']}, its peers had {sorted(donor)}")
    return problems


def contributors(report: dict) -> dict[int, list[int]]:
    """Whose batches are in each committed step: the groups that started that step's
    all-reduce in the quorum that committed it. (A group that died after starting it is
    counted when the survivors' all-reduce completed: its gradient is in their average.)"""
    quorum_of = {r["step"]: r["quorum"] for r in report["step"] if r["committed"]}
    by: dict[int, set[int]] = defaultdict(set)
    for row in report["contributed"]:
        if quorum_of.get(row["step"]) == row["quorum"]:
            by[row["step"]].add(row["group"])
    return {s: sorted(by[s]) for s in sorted(quorum_of)}


def participants_match(report: dict) -> list[str]:
    """The Manager's participant count equals the groups whose batch is in the step."""
    who = contributors(report)
    return [f"step {r['step']}: {r['participants']} participants, contributors {who[r['step']]}"
            for r in report["step"]
            if r["committed"] and r["participants"] != len(who[r["step"]])]


def replay_steps(report: dict, program: ModuleType) -> list[list[torch.Tensor]]:
    """One process, the program's model and batches; the weights after 0, 1, ... steps.

    Each step averages the gradients of the step's contributors as the program's collectives
    do: inside a group, FSDP2 divides each rank's gradient by the group's size before its
    reduce-scatter sums them (in float64 it pre-divides, ``_get_gradient_divide_factors`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); across groups, torchft's
    Manager.allreduce sums (ReduceOp.AVG becomes SUM) and divides by the participants. Then
    one SGD step."""
    size = report.get("group_size", 1)
    model = program.make_model(report["seed"], report.get("hidden", program.DIMS[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=report["lr"])
    weights = [[p.detach().clone() for p in model.parameters()]]
    for step, groups in contributors(report).items():
        total = [torch.zeros_like(p) for p in model.parameters()]
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
        for t, p in zip(total, model.parameters()):
            p.grad = t / len(groups)
        optimizer.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


def replay(report: dict, program: ModuleType) -> list[torch.Tensor]:
    """The weights after the last committed step of the one-process replay."""
    return replay_steps(report, program)[-1]


def _differs(expected: list[torch.Tensor], got: list[torch.Tensor]) -> float | None:
    """None when bitwise equal, else the largest difference."""
    if all(torch.equal(a.flatten(), b.flatten()) for a, b in zip(expected, got)):
        return None
    return max((a.flatten() - b.flatten()).abs().max().item() for a, b in zip(expected, got))


def final_equals_replay(report: dict, program: ModuleType) -> list[str]:
    """Every rank's final (full) parameters equal the one-process replay, bitwise."""
    expected = replay(report, program)
    problems = []
    for final in report["final"]:
        worst = _differs(expected, [torch.tensor(v, dtype=torch.float64) for v in final["params"]])
        if worst is not None:
            problems.append(f"group {final['group']} rank {final['rank']}: differs from the "
                            f"replay by {worst:.3g}")
    return problems


def checkpoint_params(path: str, program: ModuleType, report: dict) -> tuple[list[torch.Tensor], int]:
    """A group's checkpoint (torch.distributed.checkpoint, written by its ranks) loaded in this
    one process into the program's model: its full parameters, and the Manager's step."""
    import torch.distributed.checkpoint as dcp

    model = program.make_model(report["seed"], report.get("hidden", program.DIMS[1]))
    state = {"model": model.state_dict(), "torchft": {"step": 0, "batches_committed": 0}}
    with warnings.catch_warnings():   # "... assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
    return [p.detach().clone() for p in model.parameters()], state["torchft"]["step"]


def checkpoints_intact(report: dict, program: ModuleType) -> list[str]:
    """Every checkpoint a group made holds, bitwise, the replay's weights after its step, and its
    Manager step; a group killed inside a checkpoint left only its ``.tmp`` folder, never a
    checkpoint under the final name."""
    problems: list[str] = []
    if not report.get("checkpoint_folder"):
        return problems
    weights = replay_steps(report, program)
    ids = report["replica_ids"]
    for row in report["checkpoint"]:
        if not Path(row["path"]).is_dir():
            problems.append(f"{row['path']}: reported, not there")
            continue
        params, step = checkpoint_params(row["path"], program, report)
        worst = _differs(weights[row["step"]], params)
        if worst is not None or step != row["step"]:
            problems.append(f"{row['path']}: Manager step {step}; differs from the replay after "
                            f"step {row['step']} by {worst or 0:.3g}")
    for kill in report["killed"]:
        if kill["where"] == "checkpoint" and kill["rank"] == 0:
            final = Path(report["checkpoint_folder"], ids[kill["group"]], f"step-{kill['step'] + 1:06d}")
            if final.exists() or not final.with_name(final.name + ".tmp").is_dir():
                problems.append(f"{final}: the kill inside it should leave only {final.name}.tmp")
    return problems


def all_invariants(report: dict, program: ModuleType) -> dict[str, object]:
    """Every check above, by name; ``ok`` when all hold."""
    counted = steps_counted(report)
    found: dict[str, object] = {
        "committed_together": committed_together(report),
        "equal_after_commit": equal_after_commit(report),
        "heals_match_donor": heals_match_donor(report),
        "participants_match": participants_match(report),
        "final_equals_replay": final_equals_replay(report, program),
        "checkpoints_intact": checkpoints_intact(report, program),
        "steps_counted": counted}
    found["ok"] = counted["ok"] and not any(
        v for k, v in found.items() if k != "steps_counted")
    return found
