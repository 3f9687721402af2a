"""What must hold after a run of ``ft_train.py`` with failures injected, read from its report.

Every check returns a list of problems (empty when it holds), so that a chapter cell, a
test and the chaos test assert the same thing. The report's rows:

- ``step``: one per step a group ran: step, quorum id, participants, committed, weights
  (a digest of the parameters' bytes after the step);
- ``contributed``: written just before a group's backward (its all-reduce): group, step,
  quorum: whose batch can be inside that step's average;
- ``killed`` / ``healed``: a process exiting on purpose; a group loading a peer's state;
- ``final``: every group's parameters when it reached the last step.
"""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType

import torch


def committed_together(report: dict) -> list[str]:
    """In every quorum, a step is committed by every group that ran it, or by none."""
    votes: dict[tuple[int, int], set[bool]] = defaultdict(set)
    for row in report["step"]:
        votes[(row["step"], row["quorum"])].add(row["committed"])
    return [f"step {s} in quorum {q}: some groups committed, some did not"
            for (s, q), v in sorted(votes.items()) if len(v) > 1]


def equal_after_commit(report: dict) -> list[str]:
    """After every committed step, every group that committed it holds the same weights."""
    digests: dict[int, set[str]] = defaultdict(set)
    for row in report["step"]:
        if row["committed"]:
            digests[row["step"]].add(row["weights"])
    return [f"step {s}: {len(d)} different weights" for s, d in sorted(digests.items())
            if len(d) > 1]


def steps_counted(report: dict) -> dict:
    """Each step committed by some group (none lost) and by no group twice (none repeated).

    A group that heals at step h takes steps 0..h-1 from its peer, so its own commits plus
    the steps it received cover 0..steps-1 exactly once."""
    steps = report["steps"]
    per_group: dict[int, list[int]] = defaultdict(list)
    for row in sorted(report["step"], key=lambda r: r["time"]):
        if row["committed"]:
            per_group[row["group"]].append(row["step"])
    committed = {s for ss in per_group.values() for s in ss}
    twice = {g: sorted({s for s in ss if ss.count(s) > 1}) for g, ss in per_group.items()}
    final_steps = {r["group"]: r["step"] for r in report["final"]}
    return {"lost": sorted(set(range(steps)) - committed),
            "applied_twice": {g: t for g, t in twice.items() if t},
            "final_steps": final_steps,
            "ok": committed == set(range(steps)) and not any(twice.values())
            and sorted(final_steps) == list(range(report["groups"]))
            and set(final_steps.values()) == {steps}}


def heals_match_donor(report: dict) -> list[str]:
    """A group that heals at step h holds, bitwise, the weights its peers committed at h-1."""
    problems = []
    after: dict[int, set[str]] = defaultdict(set)
    for row in report["step"]:
        if row["committed"]:
            after[row["step"] + 1].add(row["weights"])
    for heal in report["healed"]:
        donor = after.get(heal["step"], set()) if heal["step"] > 0 else set()
        if heal["weights"] not in donor:
            problems.append(f"group {heal['group']} healed at step {heal['step']} to "
                            f"{heal['weights']}, its peers had {sorted(donor)}")
    return problems


def contributors(report: dict) -> dict[int, list[int]]:
    """Whose batch is in each committed step: the groups that started that step's all-reduce
    in the quorum that committed it. (A group that died after starting it is counted when the
    survivors' all-reduce completed: its gradient is in their average.)"""
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


def replay(report: dict, program: ModuleType) -> list[torch.Tensor]:
    """One process, the program's model and batches: each step averages the gradients of the
    step's contributors (summed in group order, divided by their number, as torchft's
    Manager.allreduce does with ReduceOp.AVG) and takes one SGD step."""
    model = program.make_model(report["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=report["lr"])
    for step, groups in contributors(report).items():
        total = [torch.zeros_like(p) for p in model.parameters()]
        for g in groups:
            model.zero_grad()
            x, y = program.batch(report["seed"], step, g)
            ((model(x) - y) ** 2).mean().backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / len(groups)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def final_equals_replay(report: dict, program: ModuleType) -> list[str]:
    """Every group's final parameters equal the one-process replay, bitwise."""
    expected = replay(report, program)
    problems = []
    for final in report["final"]:
        got = [torch.tensor(v, dtype=torch.float64) for v in final["params"]]
        if not all(torch.equal(a.flatten(), b) for a, b in zip(expected, got)):
            worst = max((a.flatten() - b).abs().max().item() for a, b in zip(expected, got))
            problems.append(f"group {final['group']}: differs from the replay by {worst:.3g}")
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
        "steps_counted": counted}
    found["ok"] = counted["ok"] and not any(
        v for k, v in found.items() if k != "steps_counted")
    return found
