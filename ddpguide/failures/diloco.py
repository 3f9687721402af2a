"""What must hold after a DiLoCo run of ``ft_train.py --diloco H`` with failures, read from its
report (the ``inner`` and ``sync`` rows, ``engine.assemble``); each check a list of problems.

torchft's DiLoCo (``local_sgd.py``) keeps, in every group, the parameters of the last sync.
A sync that fails (a peer died inside its all-reduce: ``should_commit`` is False) puts them
back, so the group's H inner steps since that sync are thrown away; a group that dies loses
the inner steps it took since its last sync; a restarted group heals in the quorum of the
next sync from a peer, which replaces what it trained before it (torchft: "Some replicas will
get the same copy of the model"). So a failure costs each group at most H inner steps, and no
committed sync is lost or taken twice.
"""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType

from ddpguide.failures.checks import nothing_left_running


def _by_incarnation(report: dict, event: str) -> dict[tuple[int, int], list[dict]]:
    rows: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for row in sorted(report[event], key=lambda r: r["time"]):
        rows[(row["group"], row["incarnation"])].append(row)
    return rows


def equal_after_sync(report: dict) -> list[str]:
    """After every committed sync, every group that committed it holds the same weights."""
    digests: dict[int, set[str]] = defaultdict(set)
    for row in report["sync"]:
        if row["committed"]:
            digests[row["step"]].add(row["weights"])
    return [f"sync {s}: {len(d)} different weights" for s, d in sorted(digests.items()) if len(d) > 1]


def failed_sync_restores(report: dict, program: ModuleType) -> list[str]:
    """A group whose sync failed holds, after it, the weights it held after its last sync
    (the initial model's, before its first one, in its first incarnation)."""
    start = program.digest(program.make_model(report["seed"], report["hidden"]))
    problems = []
    for (g, inc), rows in sorted(_by_incarnation(report, "sync").items()):
        for before, row in zip([None, *rows], rows):
            if row["committed"] or (before is None and inc > 0):
                continue
            expected = start if before is None else before["weights"]
            if row["weights"] != expected:
                problems.append(f"group {g} (incarnation {inc}): sync {row['step']} failed and "
                                f"left {row['weights']}, not the last sync's {expected}")
    return problems


def syncs_counted(report: dict) -> list[str]:
    """Each sync up to the last committed by some group, none by a group twice, and every
    group's last incarnation at the last one."""
    done: dict[int, list[int]] = defaultdict(list)
    for row in sorted(report["sync"], key=lambda r: r["time"]):
        if row["committed"]:
            done[row["group"]].append(row["step"])
    problems = [f"group {g} committed syncs {sorted({s for s in ss if ss.count(s) > 1})} twice"
                for g, ss in sorted(done.items()) if len(ss) != len(set(ss))]
    lost = set(range(report["steps"])) - {s for ss in done.values() for s in ss}
    if lost:
        problems.append(f"syncs {sorted(lost)} committed by no group")
    last = {}
    for row in sorted(report["final"], key=lambda r: r["time"]):
        last[row["group"]] = row["step"]
    if sorted(last) != list(range(report["groups"])) or set(last.values()) != {report["steps"]}:
        problems.append(f"final syncs {last}, not {report['steps']} for every group")
    return problems


def lost_windows(report: dict) -> list[dict]:
    """The inner steps thrown away: each window of a group's inner steps since its last sync
    that ended in a failed sync, in a heal (the peer's copy replaced them), or in the group's
    death (no sync after them in that incarnation)."""
    syncs = _by_incarnation(report, "sync")
    heals = _by_incarnation(report, "healed")
    out = []
    for (g, inc), inner in sorted(_by_incarnation(report, "inner").items()):
        ends = syncs.get((g, inc), [])
        start = 0.0
        for end in ends:
            taken = [r for r in inner if start < r["time"] <= end["time"]]
            healed = any(start < h["time"] <= end["time"] for h in heals.get((g, inc), []))
            if not end["committed"] or healed:
                out.append({"group": g, "incarnation": inc, "sync": end["step"],
                            "inner_steps": len(taken), "why": "healed" if healed else "failed"})
            start = end["time"]
        tail = [r for r in inner if r["time"] > start]
        final = any(r["group"] == g and r["incarnation"] == inc for r in report["final"])
        if tail and not final:
            out.append({"group": g, "incarnation": inc, "sync": None,
                        "inner_steps": len(tail), "why": "died"})
    return out


def lost_at_most_h(report: dict, h: int) -> list[str]:
    """No failure throws away more than H inner steps of a group."""
    return [f"group {w['group']} (incarnation {w['incarnation']}) lost {w['inner_steps']} inner "
            f"steps ({w['why']}), more than H = {h}" for w in lost_windows(report)
            if w["inner_steps"] > h]


def healed_before_its_first_sync(report: dict) -> list[str]:
    """A restarted group commits its first sync only in a quorum in which it healed, unless no
    sync had been committed before it started."""
    problems = []
    for (g, inc), rows in sorted(_by_incarnation(report, "sync").items()):
        first = next((r for r in rows if r["committed"]), None)
        if inc == 0 or first is None:
            continue
        began = min(r["time"] for r in report["started"] if (r["group"], r["incarnation"]) == (g, inc))
        before = any(r["committed"] and r["time"] < began for r in report["sync"])
        if before and not any(h["group"] == g and h["incarnation"] == inc and h["time"] <= first["time"]
                              for h in report["healed"]):
            problems.append(f"group {g} (incarnation {inc}) committed sync {first['step']} "
                            "without healing first")
    return problems


def checks(report: dict, program: ModuleType, h: int) -> list[dict]:
    """Every DiLoCo invariant as a ``launch.report`` check."""
    found = {"equal_after_sync": equal_after_sync(report),
             "failed_sync_restores": failed_sync_restores(report, program),
             "syncs_counted": syncs_counted(report),
             "lost_at_most_h": lost_at_most_h(report, h),
             "healed_before_its_first_sync": healed_before_its_first_sync(report),
             "nothing_left_running": nothing_left_running(report)}
    return [{"name": name, "ok": not problems, "problems": problems}
            for name, problems in found.items()]
