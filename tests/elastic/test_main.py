"""Bad input to ``python -m ddpguide.elastic`` (``ddpguide.elastic.__main__`` and
``ddpguide.elastic.checks``): for every command and bad value, one exact line on
stderr, exit code 2, nothing started, and the files beside it (a good checkpoint
and its ``.prev``) byte for byte as they were."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpguide.core.checkpoint import previous_path, save_checkpoint, training_state
from ddpguide.core.models import ConvNet, ToyModel
from ddpguide.core.processes import descendants, signal_all, store_port
from ddpguide.elastic import __main__ as cli
from ddpguide.elastic import node

ROOT = Path(__file__).resolve().parents[2]
HELP = {"top": "python -m ddpguide.elastic", "demo": "python -m ddpguide.elastic demo",
        "node": "python -m ddpguide.elastic node", "store": "python -m ddpguide.elastic store"}
NODE = ["node", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-id", "t",
        "--rdzv-endpoint", "127.0.0.1:{free}", "--checkpoint", "{ckpt}"]


def _good_checkpoint(path: Path, model: torch.nn.Module | None = None) -> None:
    """A checkpoint after epoch 0, saved twice so that its fallback ``.prev`` exists."""
    model = model or ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        save_checkpoint(training_state(0, model, optimizer, history=[]), path)


def _snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _node(*extra: str) -> list[str]:
    return [*NODE, *extra]


def _replace(option: str, value: str) -> list[str]:
    args = list(NODE)
    args[args.index(option) + 1] = value
    return args


# (id, arguments, the one line on stderr); {tmp} is the test's folder, {ckpt} the good
# checkpoint in it, {busy} a port something that is not a c10d store listens on,
# {free} a free port, {other} a ConvNet's checkpoint, {corrupt} garbage named .pt.
CASES = [
    # -- demo ------------------------------------------------------------
    ("demo-epochs", ["--epochs", "3"], "error: --epochs 3: the demo needs at least 10 epochs"),
    ("demo-epochs-word", ["demo", "--epochs", "many"],
     "{demo}: error: argument --epochs: invalid int value: 'many' (see --help)"),
    ("demo-step-delay-negative", ["--step-delay", "-1"],
     ("error: --step-delay -1: must be a number of seconds from 0 to 1 (each phase of the demo "
      "has a time limit)")),
    ("demo-step-delay-nan", ["--step-delay", "nan"],
     ("error: --step-delay nan: must be a number of seconds from 0 to 1 (each phase of the demo "
      "has a time limit)")),
    ("demo-step-delay-large", ["--step-delay", "5"],
     ("error: --step-delay 5: must be a number of seconds from 0 to 1 (each phase of the demo "
      "has a time limit)")),
    ("demo-workdir-not-empty", ["--workdir", "{tmp}"],
     "error: --workdir {tmp}: must be a new or empty directory"),
    ("demo-workdir-a-file", ["--workdir", "{ckpt}"],
     "error: --workdir {ckpt}: must be a new or empty directory"),
    ("demo-workdir-under-a-file", ["--workdir", "{ckpt}/run"],
     "error: --workdir {ckpt}/run: cannot be written in {ckpt} (not a directory)"),
    ("demo-report-no-folder", ["--report", "{tmp}/missing/r.json"],
     "error: argument --report: folder {tmp}/missing does not exist"),
    ("demo-report-a-folder", ["--report", "{tmp}"], "error: argument --report: {tmp} is a directory"),
    ("demo-unknown-option", ["--frobnicate"],
     "{top}: error: unrecognized arguments: --frobnicate (see --help)"),
    # -- node: the agent -------------------------------------------------
    ("nnodes-reversed", _replace("--nnodes", "3:1"),
     "error: --nnodes '3:1': the minimum (3) is larger than the maximum (1)"),
    ("nnodes-zero", _replace("--nnodes", "0"),
     "error: --nnodes '0': the minimum must be at least 1"),
    ("nnodes-word", _replace("--nnodes", "1:x"),
     "error: --nnodes '1:x': expected N or MIN:MAX with positive integers"),
    ("nproc-zero", _replace("--nproc-per-node", "0"),
     "error: --nproc-per-node 0: must be at least 1"),
    ("nproc-word", _replace("--nproc-per-node", "two"),
     "{node}: error: argument --nproc-per-node: invalid int value: 'two' (see --help)"),
    ("endpoint-no-port", _replace("--rdzv-endpoint", "localhost"),
     "error: --rdzv-endpoint 'localhost': expected HOST:PORT, e.g. 10.0.0.1:29400"),
    ("endpoint-no-host", _replace("--rdzv-endpoint", ":29400"),
     "error: --rdzv-endpoint ':29400': expected HOST:PORT, e.g. 10.0.0.1:29400"),
    ("endpoint-port-range", _replace("--rdzv-endpoint", "localhost:70000"),
     "error: --rdzv-endpoint 'localhost:70000': port 70000 is outside 1-65535"),
    ("endpoint-occupied", _replace("--rdzv-endpoint", "127.0.0.1:{busy}"),
     ("error: --rdzv-endpoint 127.0.0.1:{busy}: port {busy} is in use by another program, "
      "not a c10d store; pick a free port")),
    ("rdzv-id-space", _replace("--rdzv-id", "a b"),
     "error: --rdzv-id 'a b': must be a non-empty word"),
    ("max-restarts-negative", _node("--max-restarts", "-1"),
     "error: --max-restarts -1: must be >= 0"),
    ("rdzv-conf-form", _node("--rdzv-conf", "fast"),
     "error: --rdzv-conf 'fast': expected KEY=VALUE[,KEY=VALUE...]"),
    ("rdzv-conf-empty-value", _node("--rdzv-conf", "join_timeout="),
     "error: --rdzv-conf 'join_timeout=': expected KEY=VALUE[,KEY=VALUE...]"),
    ("rdzv-conf-fraction", _node("--rdzv-conf", "last_call_timeout=0.5"),
     ("error: --rdzv-conf last_call_timeout=0.5: must be a whole number >= 1 (torchrun reads "
      "these as integers)")),
    ("rdzv-conf-misspelt", _node("--rdzv-conf", "join_timout=5"),
     ("error: --rdzv-conf join_timout=5: unknown key (the c10d rendezvous reads join_timeout, "
      "last_call_timeout, close_timeout, heartbeat_timeout, keep_alive_interval, "
      "keep_alive_max_attempt, read_timeout, timeout, is_host, store_type)")),
    ("rdzv-conf-is-host", _node("--rdzv-conf", "is_host=maybe"),
     "error: --rdzv-conf is_host=maybe: must be true or false"),
    ("rdzv-conf-file-store", _node("--rdzv-conf", "store_type=file"),
     ("error: --rdzv-conf store_type=file: node mode needs the TCP store (store_type=tcp) at "
      "--rdzv-endpoint")),
    ("rdzv-conf-is-host-and-external-store",
     _node("--external-store", "--rdzv-conf", "is_host=yes"),
     "error: --rdzv-conf is_host=yes: contradicts --external-store (the store runs elsewhere)"),
    ("monitor-interval-zero", _node("--monitor-interval", "0"),
     "error: --monitor-interval 0: must be a number of seconds above 0"),
    ("monitor-interval-nan", _node("--monitor-interval", "nan"),
     "error: --monitor-interval nan: must be a number of seconds above 0"),
    ("local-addr-elsewhere", _node("--local-addr", "192.0.2.1"),
     "error: --local-addr '192.0.2.1': not an address of this machine"),
    ("local-addr-empty", _node("--local-addr", ""),
     "error: --local-addr '': must be a non-empty word"),
    ("node-name-empty", _node("--node-name", ""),
     "error: --node-name '': must be a non-empty word"),
    ("worker-start", _node("--worker-start", "thread"),
     ("{node}: error: argument --worker-start: invalid choice: 'thread' (choose from 'forkserver', 'exec') "
      "(see --help)")),
    ("start-when-no-folder", _node("--start-when", "{tmp}/missing/go"),
     ("error: --start-when {tmp}/missing/go: directory {tmp}/missing does not exist (the agent "
      "would wait for ever)")),
    ("unknown-option", _node("--frobnicate"),
     "{top}: error: unrecognized arguments: --frobnicate (see --help)"),
    # -- node: the workers -----------------------------------------------
    ("checkpoint-missing", NODE[:-2],
     "{node}: error: the following arguments are required: --checkpoint (see --help)"),
    ("checkpoint-empty", _replace("--checkpoint", ""), "error: --checkpoint '': must not be empty"),
    ("checkpoint-no-folder", _replace("--checkpoint", "{tmp}/missing/c.pt"),
     "error: --checkpoint {tmp}/missing/c.pt: checkpoint directory {tmp}/missing does not exist"),
    ("checkpoint-under-a-file", _replace("--checkpoint", "{ckpt}/c.pt"),
     "error: --checkpoint {ckpt}/c.pt: checkpoint directory {ckpt} is not a directory"),
    ("checkpoint-a-folder", _replace("--checkpoint", "{tmp}"),
     "error: --checkpoint {tmp}: is a directory"),
    ("checkpoint-other-model", _replace("--checkpoint", "{other}"),
     ("error: --checkpoint {other}: checkpoint {other} does not fit this model: Error(s) in "
      "loading state_dict for ToyModel: Missing key(s) in state_dict: ")),
    ("checkpoint-corrupt", _replace("--checkpoint", "{corrupt}"),
     "error: --checkpoint {corrupt}: no readable checkpoint: {corrupt}: "),
    ("epochs-zero", _node("--epochs", "0"), "error: --epochs 0: must be at least 1"),
    ("samples-zero", _node("--samples", "0"), "error: --samples 0: must be between 1 and 1000000"),
    ("samples-huge", _node("--samples", "10000000000"),
     "error: --samples 10000000000: must be between 1 and 1000000"),
    ("batch-size-zero", _node("--batch-size", "0"), "error: --batch-size 0: must be at least 1"),
    ("step-delay-negative", _node("--step-delay", "-0.5"),
     "error: --step-delay -0.5: must be a number of seconds from 0 to 60"),
    ("step-delay-inf", _node("--step-delay", "inf"),
     "error: --step-delay inf: must be a number of seconds from 0 to 60"),
    ("worker-timeout-negative", _node("--worker-timeout", "-1"),
     "error: --worker-timeout -1: must be a number of seconds above 0, at most 604800"),
    ("worker-timeout-zero", _node("--worker-timeout", "0"),
     "error: --worker-timeout 0: must be a number of seconds above 0, at most 604800"),
    ("worker-timeout-nan", _node("--worker-timeout", "nan"),
     "error: --worker-timeout nan: must be a number of seconds above 0, at most 604800"),
    ("events-empty", _node("--events", ""), "error: --events '': must not be empty"),
    ("events-no-folder", _node("--events", "{tmp}/missing/e.jsonl"),
     "error: argument --events: folder {tmp}/missing does not exist"),
    ("events-a-folder", _node("--events", "{tmp}"), "error: argument --events: {tmp} is a directory"),
    ("events-into-checkpoint", _node("--events", "{ckpt}.prev"),
     "error: --events {ckpt}.prev: would write into the checkpoint"),
    # -- store -----------------------------------------------------------
    ("store-port-zero", ["store", "--port", "0"], "error: --port 0: outside 1-65535"),
    ("store-port-range", ["store", "--port", "70000"], "error: --port 70000: outside 1-65535"),
    ("store-port-word", ["store", "--port", "http"],
     "{store}: error: argument --port: invalid int value: 'http' (see --help)"),
    ("store-port-missing", ["store"],
     "{store}: error: the following arguments are required: --port (see --help)"),
    ("store-port-busy", ["store", "--port", "{busy}"],
     "error: --port {busy}: already in use on this machine"),
    ("store-host-empty", ["store", "--port", "{free}", "--host", ""],
     "error: --host '': must be a non-empty word"),
]
PREFIX_ONLY = {"checkpoint-other-model", "checkpoint-corrupt"}  # torch's own text follows


@pytest.fixture
def folder(tmp_path):
    """A good checkpoint with its fallback, and the odd files the cases name."""
    _good_checkpoint(tmp_path / "checkpoint.pt")
    _good_checkpoint(tmp_path / "convnet.pt", ConvNet())
    (tmp_path / "corrupt.pt").write_bytes(b"\x80garbage")
    return tmp_path


@pytest.fixture
def busy_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def _fill(text: str, folder: Path, busy: int, free: int) -> str:
    return text.format(tmp=folder, ckpt=folder / "checkpoint.pt", other=folder / "convnet.pt",
                       corrupt=folder / "corrupt.pt", busy=busy, free=free, **HELP)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, args, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_exact_line_exit_2_and_touches_nothing(case, args, message, folder,
                                                                busy_port, monkeypatch, capsys):
    started = []
    # What would start processes: a missing check then fails here instead of running.
    monkeypatch.setattr(cli, "_demo", lambda plan: started.append("demo") or 0)
    monkeypatch.setattr(node, "run_node", lambda options: started.append("node") or 0)
    monkeypatch.setattr(node, "run_store", lambda options: started.append("store") or 0)
    free = store_port()
    args = [_fill(a, folder, busy_port, free) for a in args]
    expected = _fill(message, folder, busy_port, free)
    before, children = _snapshot(folder), set(descendants(os.getpid()))
    assert previous_path(folder / "checkpoint.pt") in before
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse exits by itself
        code = exc.code
    err = capsys.readouterr()
    assert (code, started, err.out) == (2, [], "")
    if case in PREFIX_ONLY:
        assert err.err.count("\n") == 1 and err.err.startswith(expected), err.err
    else:
        assert err.err == expected + "\n"
    assert _snapshot(folder) == before
    assert set(descendants(os.getpid())) <= children


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m ddpguide.elastic ARGS`` in a session of its own, whose tree dies after."""
    process = subprocess.Popen([sys.executable, "-m", "ddpguide.elastic", *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        signal_all([process.pid, *descendants(process.pid)], signal.SIGKILL)
        process.wait(10)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


@pytest.mark.timeout(150)
def test_node_with_no_samples_is_refused_and_keeps_the_good_checkpoint(folder):
    """Once, ``--samples 0`` started the agent, trained nothing, logged "loss 0.0000",
    exited 0, saved, and pushed the good checkpoint to ``.prev``."""
    before = _snapshot(folder)
    result = _run(["node", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint",
                   f"127.0.0.1:{store_port()}", "--checkpoint", str(folder / "checkpoint.pt"),
                   "--epochs", "3", "--samples", "0"])
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", "error: --samples 0: must be between 1 and 1000000\n")
    assert _snapshot(folder) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option, value", [("--batch-size", "0"), ("--worker-timeout", "-1")])
def test_node_refuses_worker_options_before_the_workers_see_them(option, value, folder):
    """Once, these reached the workers, and the agent printed two tracebacks."""
    before = _snapshot(folder)
    result = _run(["node", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint",
                   f"127.0.0.1:{store_port()}", "--checkpoint", str(folder / "checkpoint.pt"),
                   option, value])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {option} {value}: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert _snapshot(folder) == before
