"""What must hold after a run of ``ft_train.py`` with failures injected, read from its report.

Every check returns a list of problems (empty when it holds), so that a chapter cell, a
test and the chaos run assert the same thing. The report's rows (``engine.assemble``),
each with its group, its rank in the group, its incarnation (torchrun's restart count) and
its time: ``contributed`` (before a rank's backward), ``step`` (after it: committed or not,
participants, weights digest), ``healed``, ``checkpoint``, ``final``; and the engine's own
keys: ``failures`` (what was done, when, and to whom) and ``left_running``.

A quorum is named here by its step and its number of participants: torchft 0.2.0 keeps its
quorum id private, and a step tried again after a failure is tried by a quorum of another
size (the dead group is out of it).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import torch

from ddpguide.failures.replay import contributors, replay, replay_steps


def committed_together(report: dict) -> list[str]:
    """Every rank of a group commits a step or none does; a group that did not commit a step
    its quorum's other groups committed takes no step of its own again before it has healed.

    torchft votes on a commit inside each group only (``Manager.should_commit``: "Different
    replica groups may return different values"): a group stopped or failing after its share
    of the all-reduce reached the others leaves them a complete sum, which they commit, while
    its own all-reduce fails. It is then behind, and the next quorum heals it from a peer. A
    group that went on from its own state (committed again, or ended, with no heal between)
    would have split from the others. A rank that commits the step later, in a quorum of the
    same size (a group alone that tries a step again), did not split."""
    voters: dict[tuple[int, int], dict[bool, set]] = defaultdict(lambda: {True: set(), False: set()})
    refused: dict[tuple[int, int, int, int], float] = {}  # (step, participants, group, rank) -> time
    for row in report["step"]:
        voters[(row["step"], row["participants"])][row["committed"]].add((row["group"], row["rank"]))
        if not row["committed"]:
            key = (row["step"], row["participants"], row["group"], row["rank"])
            refused[key] = min(refused.get(key, row["time"]), row["time"])
    problems = []
    for (s, n), v in sorted(voters.items()):
        split = v[False] - v[True]
        if not v[True] or not split:
            continue
        groups_split = sorted({g for g, _ in split} & {g for g, _ in v[True]})
        if groups_split:  # ranks of one group disagree
            problems.append(f"step {s} with {n} participants: group {groups_split[0]} split: "
                            f"{sorted(v[True])} committed, {sorted(split)} did not")
        for group, rank in sorted(split):
            since = refused[(s, n, group, rank)]
            mine = [r for r in report["step"] + report["final"] + report["healed"]
                    if (r["group"], r["rank"]) == (group, rank) and r["time"] > since]
            ahead = [r for r in mine if r["event"] == "final" or r.get("committed")]
            if not ahead:
                continue
            next_time = min(r["time"] for r in ahead)
            if not any(r["event"] == "healed" and r["time"] < next_time for r in mine):
                problems.append(f"step {s} with {n} participants: {sorted(v[True])} committed, "
                                f"{(group, rank)} did not and went on without healing")
    return problems


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
    everyone = [f"{g}.{r}" for g in range(report["groups"]) for r in range(report["group_size"])]
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


def heals_carry_the_state(report: dict, program: ModuleType) -> list[str]:
    """With the program's --state-mb: a rank that heals holds, bitwise, the state every group
    filled from the seed at its first start and never changed (a restarted rank leaves its own
    unfilled: only the heal fills it)."""
    heals = [h for h in report["healed"] if "state" in h]
    if not report.get("state_mb") or not heals:
        return []
    filled = program.digest_of([program.make_state(report["seed"], report["state_mb"], 0)])
    return [f"group {h['group']} rank {h['rank']} healed at step {h['step']} to state "
            f"{h['state']}, its peers hold {filled}" for h in heals if h["state"] != filled]


def participants_match(report: dict) -> list[str]:
    """The Manager's participant count equals the groups whose batch is in the step."""
    who = contributors(report)
    return [f"step {r['step']}: {r['participants']} participants, contributors {who[r['step']]}"
            for r in report["step"]
            if r["committed"] and r["participants"] != len(who[r["step"]])]


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
    """Every checkpoint a group made holds, bitwise, the replay's weights after its step, and
    its Manager step."""
    problems: list[str] = []
    if not report["checkpoint"]:
        return problems
    weights = replay_steps(report, program)
    for row in report["checkpoint"]:
        if not Path(row["path"]).is_dir():
            problems.append(f"{row['path']}: reported, not there")
            continue
        params, step = checkpoint_params(row["path"], program, report)
        worst = _differs(weights[row["step"]], params)
        if worst is not None or step != row["step"]:
            problems.append(f"{row['path']}: Manager step {step}; differs from the replay after "
                            f"step {row['step']} by {worst or 0:.3g}")
    return problems


def back_and_healed(report: dict) -> list[str]:
    """Every group that died (a rank started again by torchrun) is back by the end: its last
    incarnation healed from a live peer, unless it had committed nothing before it died, and
    wrote the final row."""
    problems = []
    for g in range(report["groups"]):
        for r in range(report["group_size"]):
            starts = [row for row in report["started"] if (row["group"], row["rank"]) == (g, r)]
            last = max((row["incarnation"] for row in starts), default=0)
            if last == 0:
                continue
            final = [row for row in report["final"] if (row["group"], row["rank"]) == (g, r)
                     and row["incarnation"] == last]
            healed = [row for row in report["healed"] if (row["group"], row["rank"]) == (g, r)
                      and row["incarnation"] == last]
            if not final:
                problems.append(f"group {g} rank {r}: restarted {last} times, not back at the end")
            elif not healed and any(row["committed"] for row in report["step"] if row["step"] > 0):
                problems.append(f"group {g} rank {r}: back without healing from a peer")
    return problems


def survivors_keep_going(report: dict, bound_s: float) -> list[str]:
    """After every failure, every group it did not hit commits a step within ``bound_s``
    seconds (unless it had already done its last step)."""
    problems = []
    for failure in report["failures"]:
        hit = set(failure.get("groups", []))
        for g in range(report["groups"]):
            if g in hit:
                continue
            done = min((row["time"] for row in report["final"] if row["group"] == g
                        and row["rank"] == 0), default=float("inf"))
            if done <= failure["time"] + bound_s:
                continue
            if not any(failure["time"] < row["time"] <= failure["time"] + bound_s
                       for row in report["step"] if row["group"] == g and row["committed"]):
                problems.append(f"group {g} committed nothing within {bound_s:g} s of "
                                f"{failure['what']} at {failure['time'] - report['start']:.1f} s")
    return problems


def nothing_left_running(report: dict) -> list[str]:
    """No process the engine started is alive after it stopped."""
    return [f"pid {pid} still running" for pid in report["left_running"]]


def checks(report: dict, program: ModuleType, stall_bound_s: float) -> list[dict]:
    """Every invariant as a ``launch.report`` check: name, ok, and the problems found."""
    counted = steps_counted(report)
    found: dict[str, list] = {
        "committed_together": committed_together(report),
        "equal_after_commit": equal_after_commit(report),
        "heals_match_donor": heals_match_donor(report) + heals_carry_the_state(report, program),
        "back_and_healed": back_and_healed(report),
        "survivors_keep_going": survivors_keep_going(report, stall_bound_s),
        "participants_match": participants_match(report),
        "steps_counted": [] if counted["ok"] else [
            f"lost {counted['lost']}, applied twice {counted['applied_twice']}, "
            f"final steps {counted['final_steps']}"],
        "final_equals_replay": final_equals_replay(report, program),
        "checkpoints_intact": checkpoints_intact(report, program),
        "nothing_left_running": nothing_left_running(report)}
    return [{"name": name, "ok": not problems, "problems": problems}
            for name, problems in found.items()]
