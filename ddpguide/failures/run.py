"""One run of the chapter's job with (or without) chaos, checked: ``run`` starts the
lighthouse and the groups' torchrun jobs (:mod:`.engine`), injects the failures
(:mod:`.chaos`), stops everything, and writes the report with one check per invariant
(:mod:`.checks`); the report is read back through ``launch.report``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ddpguide.failures import chaos, checks, diloco, engine
from ddpguide.launch import programs
from ddpguide.launch import report as contract

#: gloo's tries at connecting a new process group (retryLimit=3 in its "failed to connect" log)
GLOO_CONNECT_TRIES = 4


def stall_bound_s(settings: engine.Settings) -> float:
    """How long a survivor may go without committing after a failure: a hung peer holds its
    all-reduce for the collective's timeout; a peer that comes back (SIGCONT) while still
    inside its old step joins a quorum it cannot serve, and the survivor's new process group
    tries to connect to it ``GLOO_CONNECT_TRIES`` times, a timeout each; the lighthouse then
    waits out the heartbeat and the join timeout; and ten ordinary steps and 2 s of slack."""
    return ((1 + GLOO_CONNECT_TRIES) * settings.timeout_s
            + (settings.heartbeat_timeout_ms + settings.join_timeout_ms) / 1000
            + 10 * settings.step_seconds + 2.0)


def run(settings: engine.Settings, folder: str | os.PathLike, failures: int = 0, seed: int = 0,
        kinds: tuple[str, ...] = chaos.KINDS, margin: int = 10, in_order: bool = False,
        hang_ends: tuple[signal.Signals, ...] = (signal.SIGKILL, signal.SIGCONT),
        gap_s: tuple[float, float] = (1.0, 3.0), before=None, after=None) -> dict:
    """Run, inject ``failures`` failures drawn from ``seed`` (of ``kinds`` in turn when
    ``in_order``; a hang ended by one of ``hang_ends``; each a random ``gap_s`` after every
    group is back, and after ``before(kind)``, whose keys go into the failure's entries, as
    do ``after(kind)``'s, called once every group is back after the failure; once
    they are done and every group is back, the run ends ``margin`` steps later, before
    --steps), check; the report as read back."""
    folder = Path(folder)
    start = time.time()
    until = time.monotonic() + settings.deadline_s
    job = engine.Job(settings, folder)
    try:
        job.start()
        log: list[dict] = []
        if failures:
            trouble = chaos.Chaos(job, seed, kinds, gap_s, in_order, hang_ends, before, after)
            log = trouble.run(failures, until, margin)
            trouble.end_soon(until, margin)
        finished = job.wait(until)
    finally:
        left = job.stop()
    rows = engine.read_rows(folder)
    report = engine.assemble(settings, rows, engine.last_step(settings, folder), start=start,
                             seconds=time.time() - start,
                             commands=job.commands, finished=finished,
                             exit_codes=job.ranks.returncodes()[1:len(job.agents) + 1],
                             failures=chaos.landed(log, rows), left_running=left)
    program = programs.load(engine.PROGRAM)
    if "--diloco" in settings.extra:
        found = diloco.checks(report, program, int(settings.extra[settings.extra.index("--diloco") + 1]))
    else:
        found = checks.checks(report, program, stall_bound_s(settings))
    found.append({"name": "every_group_finished", "ok": finished and all(
        c == 0 for c in report["exit_codes"]), "problems": [] if finished else ["deadline"]})
    report["checks"] = found
    engine.write_report(folder / "report.json", report)
    return contract.read(folder / "report.json", "the failures engine")
