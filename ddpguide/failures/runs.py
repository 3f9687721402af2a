"""Runs of the chapter's programs with failures injected, and the time each failure costs.

``run_ft`` runs ``ft_train.py`` under the engine and returns its checked report.
``ft_lost_s`` reads, from a report, what each failure cost the survivors. ``torchrun_lost_s`` runs chapter
4's ``elastic_train.py`` under torchrun, kills one worker, and measures the same thing:
torchrun stops the other worker, starts both again, and they reload the checkpoint.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ddpguide.core.processes import descendants, signal_all
from ddpguide.launch import programs
from ddpguide.launch import report as reports
from ddpguide.launch.ranks import Command, Outcome, Ranks

PROGRAM = "ft_train.py"


def run_ft(folder: str | Path, failures: int = 0, seed: int = 0,
           kinds: tuple[str, ...] = ("kill",), in_order: bool = False,
           hang_ends: tuple[int, ...] = (signal.SIGKILL, signal.SIGCONT),
           gap_s: tuple[float, float] = (1.0, 3.0), before=None, after=None,
           **settings: object) -> dict:
    """``ft_train.py`` under the engine (lighthouse + one torchrun per group) in ``folder``,
    with ``failures`` failures of ``kinds`` from ``seed`` (``before``, ``after``: see ``run.run``); the
    checked report."""
    from ddpguide.failures import engine, run

    return run.run(engine.Settings(**settings), folder, failures, seed, kinds,  # type: ignore[arg-type]
                   in_order=in_order, hang_ends=tuple(signal.Signals(s) for s in hang_ends),
                   gap_s=gap_s, before=before, after=after)


class StartProbe:
    """P timed beside the run: a separate start of ``ft_train.py`` as a restarted group's rank
    (incarnation 1, a group of one, its own store), against a lighthouse of its own, from the
    exec to its built Manager (its ``started`` row, the program's own clock); then it is
    killed (``state_mb``: its --state-mb, the state a restarted rank allocates). Calling it
    (``probe(kind)``, as ``run_ft``'s ``before``) gives ``{"start_s": P}``."""

    def __init__(self, folder: str | Path, timeout: float = 120.0, state_mb: int = 0):
        self.folder, self.timeout, self.state_mb = Path(folder), timeout, state_mb
        self.lighthouse: subprocess.Popen | None = None

    def __enter__(self) -> StartProbe:
        from ddpguide.core.processes import store_port
        from ddpguide.failures import engine

        port = store_port()
        self.url = f"http://127.0.0.1:{port}"
        self.lighthouse = subprocess.Popen(engine.lighthouse_argv(engine.Settings(), port),
                                           env={**os.environ, "RUST_LOG": "error"},
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.timeout))
            until = time.monotonic() + self.timeout
            while not programs.load(PROGRAM).lighthouse_reachable(self.url, 0.2):
                if time.monotonic() > until or self.lighthouse.poll() is not None:
                    raise RuntimeError(f"the probe's lighthouse did not start ({self.url})")
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __call__(self, kind: str = "") -> dict:
        from ddpguide.failures import engine

        probe = self.folder / f"probe{len(list(self.folder.glob('probe*')))}"
        env = {**os.environ, "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2",
               "TORCHFT_LIGHTHOUSE": self.url, "TORCHELASTIC_RESTART_COUNT": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
        probe.mkdir(parents=True)
        started = time.time()
        child = subprocess.Popen([sys.executable, str(programs.path_of(PROGRAM)), "--rows",
                                  str(probe / "rows"), "--linger", "0", "--timeout", "5",
                                  "--state-mb", str(self.state_mb)], env=env,
                                 cwd=self.folder, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            until = time.monotonic() + self.timeout
            while not (row := next((r for r in engine.read_rows(probe)
                                    if r["event"] == "started"), None)):
                if time.monotonic() > until or child.poll() is not None:
                    raise RuntimeError(f"the start probe wrote no started row (exit status "
                                       f"{child.poll()})")
                time.sleep(0.01)
        finally:
            child.kill()
            child.wait(30)
        return {"start_s": row["time"] - started}

    def __exit__(self, *exc: object) -> None:
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait(30)


def run_plain_ddp(folder: Path, steps: int) -> dict:
    """``torchrun --standalone --nproc-per-node=2 ft_train.py --plain-ddp`` (torch's DDP, no
    torchft) in ``folder``, no step sleep: its step rows, shaped as a report's."""
    from ddpguide.failures import engine
    from ddpguide.launch.torchrun import run_torchrun

    folder.mkdir(parents=True, exist_ok=True)
    ran = run_torchrun(["--standalone", "--nproc-per-node=2"], str(programs.path_of(PROGRAM)),
                       ["--plain-ddp", "--rows", str(folder / "rows"), "--steps", str(steps),
                        "--step-seconds", "0"], timeout=180)
    if not ran.ok:
        raise RuntimeError(f"plain DDP exited with {ran.returncode}:\n{ran.output[-2000:]}")
    return {"inner": [], "step": [r for r in engine.read_rows(folder) if r["event"] == "step"]}


def heal_bytes(settings) -> int:
    """The state a heal moves: the model's parameters (SGD without momentum keeps no state)
    and the program's --state-mb state."""
    model = programs.load(PROGRAM).make_model(settings.seed, settings.hidden)
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + settings.state_mb * 2**20 // 8 * 8)


def copied(folder: str | Path) -> Path:
    """A copy of ``ft_train.py`` alone in ``folder``, for runs started elsewhere (on the nodes
    of chapter 15's cluster)."""
    return programs.copy_program(PROGRAM, folder)


def step_interval_s(times: list[float]) -> float:
    """The median time between consecutive steps (what one step costs without a failure)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0


def lost_s(report: dict, failure: dict, window: int = 3) -> float | None:
    """How long the first group ``failure`` did not hit stalled: the gaps between its commits
    from the last one before the failure to the ``window``-th after it, less ``window``
    ordinary steps (the median gap between its commits before it); None without commits on
    both sides."""
    spared = min(g for g in range(report["groups"]) if g not in failure["groups"])
    mine = sorted(r["time"] for r in report["step"] if r["committed"] and r["rank"] == 0
                  and r["group"] == spared)
    before = [t for t in mine if t <= failure["time"]]
    after = [t for t in mine if t > failure["time"]][:window]
    if not (before and after):
        return None
    return after[-1] - before[-1] - len(after) * step_interval_s(before)


def ft_lost_s(report: dict, window: int = 3) -> list[float]:
    """For each failure (that has commits on both sides): what it cost the survivors."""
    lost = (lost_s(report, f, window) for f in report["failures"])
    return [x for x in lost if x is not None]


def _workers(agent: int) -> list[int]:
    """The processes below torchrun's agent that run the program (its workers)."""
    found = []
    for pid in descendants(agent):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"elastic_train.py") for part in command):
            found.append(pid)
    return found


def torchrun_lost_s(kill_after_epochs: int = 3, epoch_seconds: float = 0.1,
                    timeout: float = 180.0) -> dict:
    """torchrun --standalone --nproc-per-node=2 --max-restarts=1 elastic_train.py; SIGKILL of
    worker 1 after ``kill_after_epochs`` epochs; the gap between the last epoch before the kill
    and the first epoch of the restarted group, less one ordinary epoch (as ``ft_lost_s``). The
    epoch log is polled every 20 ms (its lines' arrival times are the measurement)."""
    with tempfile.TemporaryDirectory(prefix="ddpguide-torchrun-") as tmp:
        folder = Path(tmp)
        source = programs.copy_program("elastic_train.py", folder)
        log = folder / "epochs.jsonl"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--max-restarts=3", "--monitor-interval=0.5",
                str(source), "--epochs", "1000", "--epoch-seconds", str(epoch_seconds),
                "--checkpoint", str(folder / "checkpoint.pt"), "--epoch-log", str(log)]
        arrivals: list[tuple[float, dict]] = []

        def poll() -> None:  # the epoch log is a live log (launch.report.read_log)
            arrivals.extend((time.time(), e) for e in reports.read_log(log)[len(arrivals):])

        with Ranks() as group:
            agent = group.start(Command(argv, cwd=str(folder),
                                        env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}))

            def seen(predicate) -> bool:
                poll()
                return any(predicate(e) for _, e in arrivals)

            if group.wait(timeout, until=lambda: seen(lambda e: e["epoch"] >= kill_after_epochs)) \
                    is not Outcome.UNTIL:
                raise RuntimeError(f"torchrun: no epoch {kill_after_epochs} within {timeout} s:\n"
                                   f"{group.ended().output[-2000:]}")
            workers = _workers(group.pid(agent))
            before = [t for t, _ in arrivals]
            killed = time.time()
            signal_all(workers[-1:], 9)
            if group.wait(timeout, until=lambda: seen(lambda e: e["restart_count"] >= 1)) \
                    is not Outcome.UNTIL:
                raise RuntimeError(f"torchrun: no epoch after the kill within {timeout} s:\n"
                                   f"{group.ended().output[-2000:]}")
            group.stop(grace=2.0)
        first = next(t for t, e in arrivals if e["restart_count"] >= 1)
        interval = step_interval_s(before)
        return {"lost_s": first - before[-1] - interval, "epoch_s": interval,
                "kill_to_first_epoch_s": first - killed}
