"""A GPT run that loses a node and goes on with fewer ranks on another layout.

Two torchrun agents of 2 workers each join one elastic job (c10d rendezvous on
127.0.0.1, ``--nnodes 1:2``) and train ``train.py --tp 2 --dp-shard auto`` (FSDP x TP
2 x 2), saving a checkpoint after every step. Once a checkpoint exists, the second
agent and its workers are killed (SIGKILL: the machine is gone). The first agent's
workers fail, it restarts them, the rendezvous closes with the one node left, and
``--dp-shard auto`` makes the 2 ranks a TP 2 layout that ``--resume`` starts from the
latest complete checkpoint. Its report (``--report``, read with
:func:`ddpguide.launch.report.read`) holds every step's loss, the ones
before the checkpoint from the checkpoint's record: compared with one uninterrupted
process, no step is lost or repeated.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddpguide.core.processes import DIE_WITH_PARENT_ENV, store_port
from ddpguide.gpt.layouts import PROGRAM, check_options, trained
from ddpguide.launch import ranks
from ddpguide.launch import report as reports
from ddpguide.launch.programs import copy_program

#: rendezvous settings that make a lost node noticed in seconds (chapter 4 measures them)
RDZV_CONF = "join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class Recovery:
    losses: list[float]
    first_step: int  # the step the restarted run resumed from
    killed_after: int  # the latest complete checkpoint when the node was killed
    layout: dict  # the restarted run's layout
    seconds: float
    logs: dict[str, str]


def agent_command(port: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gpt",
            "--rdzv-conf", RDZV_CONF, "--max-restarts", "1", "--monitor-interval", "0.5",
            "--local-addr", "127.0.0.1", "train.py", *args]


def completed(folder: Path) -> list[int]:
    return sorted(int(p.parent.name[len("step-"):]) for p in folder.glob("step-*/meta.json"))


def lose_a_node(workdir: Path, steps: int = 8, kill_after: int = 2, timeout: float = 400.0) -> Recovery:
    """Run the scenario; return the final loss record and when the node was lost."""
    copy_program(PROGRAM, workdir)
    args = ["--tp", "2", "--dp-shard", "auto", *check_options(steps=steps), "--save", str(workdir / "checkpoints"),
            "--save-every", "1", "--resume", "--report", str(workdir / "report.json")]
    env = {"PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", DIE_WITH_PARENT_ENV: "1"}
    port = store_port()
    logs = {name: workdir / f"agent-{name}.log" for name in ("a", "b")}
    started = time.monotonic()
    with ranks.Ranks() as group:
        a = group.start(ranks.Command(agent_command(port, args), env, cwd=workdir, log=logs["a"]))
        time.sleep(1.0)  # a first: it hosts the rendezvous store and must survive
        b = group.start(ranks.Command(agent_command(port, args), env, cwd=workdir, log=logs["b"]))
        group.wait(timeout, until=lambda: len(completed(workdir / "checkpoints")) >= kill_after
                   or not group.alive(a), all_end=True)
        if len(completed(workdir / "checkpoints")) < kill_after:
            raise RuntimeError(f"no checkpoint of step {kill_after}:\n{logs['a'].read_text()[-3000:]}")
        killed_after = completed(workdir / "checkpoints")[-1]
        group.signal(b, signal.SIGKILL, tree=True)
        group.wait(max(1.0, timeout - (time.monotonic() - started)), until=lambda: not group.alive(a),
                   all_end=True)
        code = group.returncode(a)
    text = {name: path.read_text() for name, path in logs.items()}
    if code != 0:
        raise RuntimeError(f"the surviving agent exited with {code}:\n{text['a'][-3000:]}")
    what = f"{PROGRAM} under the surviving agent"
    losses, first, layout = trained(reports.read(workdir / "report.json", what), what)
    return Recovery(losses, first, killed_after, layout, time.monotonic() - started, text)
