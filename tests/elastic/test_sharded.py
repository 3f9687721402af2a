"""``--strategy fsdp``: FSDP2 workers whose DCP checkpoint every new group reshards.

The loop on its own (saved by 2 ranks, resumed by 3, loaded by one process with
no group, compared with a one-process replay of the same schedule), the report
of a sharded run, the input checks of the sharded mode, and the demo end to end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddpguide.core.checkpoint import previous_path, save_checkpoint, training_state
from ddpguide.core.models import ConvNet, ToyModel
from ddpguide.core.processes import descendants, store_port
from ddpguide.elastic import __main__ as cli
from ddpguide.elastic import node
from ddpguide.elastic.demo import MIN_EPOCHS, DemoSettings, run_cli
from ddpguide.elastic.report import RunLog, build_report, summary
from ddpguide.elastic.settings import UsageError
from ddpguide.elastic.worker import toy_data
from ddpguide.elastic.worker_args import WorkerArgs
from ddpguide.launch.spawn import spawn
from ddpguide.sharding.dcp import load_sharded, read_extra, save_sharded
from ddpguide.sharding.fsdp_strategy import FSDP2, replay
from ddpguide.train.loop import TrainConfig, fit

TOLERANCE = 1e-6  # float32 sums in another order (ranks' gradients reduced, not one batch)


def _config(checkpoint: Path, epochs: int) -> TrainConfig:
    return TrainConfig(model="toy", epochs=epochs, batch_size=8, checkpoint=str(checkpoint),
                       log=False, progress=False, evaluate=False)


def _close(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert params.keys() == reference.keys()
    return max((params[k] - reference[k]).abs().max().item() for k in params)


@pytest.mark.timeout(240)
def test_saved_by_2_resumes_on_3_at_the_next_epoch_and_loads_into_one_process(tmp_path):
    checkpoint, data = tmp_path / "checkpoint", toy_data(64)
    two = spawn(fit, 2, _config(checkpoint, 2), kwargs={"data": data, "strategy": FSDP2()}, timeout=150,
                echo=False)
    assert [(r.start_epoch, r.saved_by) for r in two] == [(0, None)] * 2
    assert read_extra(checkpoint)["world_size"] == 2
    three = spawn(fit, 3, _config(checkpoint, 4), kwargs={"data": data, "strategy": FSDP2()}, timeout=150,
                  echo=False)
    assert [(r.start_epoch, r.saved_by) for r in three] == [(2, 2)] * 3
    history = three[0].history
    assert [(h["epoch"], h["world_size"]) for h in history] == [(0, 2), (1, 2), (2, 3), (3, 3)]
    assert history[:2] == two[0].history  # the saved epochs came back, not run again
    for other in three[1:]:
        assert _close(other.parameters, three[0].parameters) == 0.0
    # One process, no group: the same epochs at the same world sizes.
    assert _close(three[0].parameters, replay(_config(checkpoint, 4), data, [2, 2, 3, 3])) < TOLERANCE
    model = ToyModel()
    extra = load_sharded(model, None, checkpoint)  # no process group: loads whole tensors
    assert extra["epoch"] == 3 and extra["history"] == history
    assert _close(dict(model.named_parameters()), three[0].parameters) == 0.0


def _start(t: float, world: int, epoch: int, saved_by: int | None) -> dict:
    return {"t": t, "event": "start", "world_size": world, "rank": 0, "node": "A", "restart": 0,
            "epoch": epoch, "resumed": epoch > 0, "saved_by": saved_by}


def test_the_report_of_a_sharded_run_names_its_reshards(tmp_path):
    history = [{"epoch": i, "world_size": w, "train_loss": 1.0, "test_accuracy": None,
                "seconds": 1.0} for i, w in enumerate([2, 4, 2])]
    model = ToyModel()
    save_sharded(model, None, tmp_path / "checkpoint",
                 extra={"epoch": 2, "history": history, "world_size": 2})
    lines: list[str] = []
    log = RunLog(echo=lines.append)
    log.action("node A starts with 2 workers", 100.0, world_size=2)
    for t, world, epoch, saved_by in ((101.0, 2, 0, None), (104.0, 4, 1, 2), (108.0, 2, 2, 4)):
        log.worker_event(_start(t, world, epoch, saved_by))
    log.worker_event({**_start(109.0, 2, 2, None), "event": "finished"})
    report = build_report(log, SimpleNamespace(checkpoint=tmp_path / "checkpoint", nodes={}),
                          DemoSettings(epochs=3, strategy="fsdp"))
    assert lines[2] == ("   4.0 s  worker group of 4 resumes at epoch 1 from shards saved by 2 "
                        "ranks (node A, restart count 0)")
    assert [(g["world_size"], g.get("saved_by")) for g in report["groups"]] == [
        (2, None), (4, 2), (2, 4)]
    assert [(e["epoch"], e["world_size"]) for e in report["epochs"]] == [(0, 2), (1, 4), (2, 2)]
    assert report["finished"] and report["settings"]["strategy"] == "fsdp"
    assert ("  sharded checkpoint (FSDP2 + DCP), resharded on load: 2 -> 4 ranks, 4 -> 2 ranks"
            in summary(report).splitlines())


# -- input checks -------------------------------------------------------------

NODE = ["node", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-id", "t",
        "--rdzv-endpoint", "127.0.0.1:{free}"]
FSDP = ["--strategy", "fsdp"]

# (id, arguments, the one line on stderr, or None: accepted); {tmp} is the test's folder.
CASES = [
    ("fsdp-a-ddp-checkpoint", [*FSDP, "--checkpoint", "{tmp}/ddp.pt"],
     ("error: --checkpoint {tmp}/ddp.pt: {tmp}/ddp.pt is a file, not a directory: a one-file "
      "checkpoint is --strategy ddp's (--strategy fsdp saves a DCP directory)")),
    ("fsdp-fallback-a-file", [*FSDP, "--checkpoint", "{tmp}/ddp"],
     ("error: --checkpoint {tmp}/ddp: {tmp}/ddp.prev is a file, not a directory: a one-file "
      "checkpoint is --strategy ddp's (--strategy fsdp saves a DCP directory)")),
    ("fsdp-another-model", [*FSDP, "--checkpoint", "{tmp}/convnet"],
     ("error: --checkpoint {tmp}/convnet: checkpoint {tmp}/convnet was written for another "
      "model: it has no 'net1.weight'")),
    ("fsdp-not-a-checkpoint", [*FSDP, "--checkpoint", "{tmp}/notes"],
     ("error: --checkpoint {tmp}/notes: checkpoint directory '{tmp}/notes' holds files that are "
      "not a checkpoint; refusing to replace it")),
    ("fsdp-no-folder", [*FSDP, "--checkpoint", "{tmp}/missing/checkpoint"],
     ("error: --checkpoint {tmp}/missing/checkpoint: checkpoint directory {tmp}/missing does "
      "not exist")),
    ("fsdp-events-inside", [*FSDP, "--checkpoint", "{tmp}/toy", "--events", "{tmp}/toy/e.jsonl"],
     "error: --events {tmp}/toy/e.jsonl: would write into the checkpoint"),
    ("ddp-a-dcp-directory", ["--checkpoint", "{tmp}/toy"],
     ("error: --checkpoint {tmp}/toy: is a sharded checkpoint (a DCP directory): resume it with "
      "--strategy fsdp")),
    ("strategy-unknown", ["--strategy", "zero3", "--checkpoint", "{tmp}/toy"],
     ("python -m ddpguide.elastic node: error: argument --strategy: invalid choice: 'zero3' "
      "(choose from 'ddp', 'fsdp') (see --help)")),
    ("fsdp-resumes-the-toy-model", [*FSDP, "--checkpoint", "{tmp}/toy"], None),
    ("fsdp-a-new-directory", [*FSDP, "--checkpoint", "{tmp}/new"], None),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A ddp checkpoint (with its .prev), DCP directories of the toy model and of a ConvNet."""
    tmp = tmp_path_factory.mktemp("inputs")
    model = ToyModel()
    for _ in range(2):
        save_checkpoint(training_state(0, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       history=[]), tmp / "ddp.pt")
    previous_path(tmp / "ddp").write_bytes((tmp / "ddp.pt").read_bytes())
    save_sharded(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp / "toy",
                 extra={"epoch": 0, "history": [], "world_size": 1})
    save_sharded(ConvNet(), None, tmp / "convnet")
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("mine")
    return tmp


def _snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, extra, message", CASES, ids=[c[0] for c in CASES])
def test_sharded_inputs_are_checked_before_anything_starts(case, extra, message, folder,
                                                            monkeypatch, capsys):
    started = []
    monkeypatch.setattr(node, "run_node", lambda options: started.append(options) or 0)
    free = store_port()
    args = [a.format(tmp=folder, free=free) for a in [*NODE, *extra]]
    before, children = _snapshot(folder), set(descendants(os.getpid()))
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse exits by itself
        code = exc.code
    err = capsys.readouterr()
    if message is None:
        assert (code, err.err) == (0, "") and started[0].worker.strategy == "fsdp"
    else:
        assert (code, started, err.out, err.err) == (2, [], "", message.format(tmp=folder) + "\n")
    assert _snapshot(folder) == before and not (folder / "new").exists()
    assert set(descendants(os.getpid())) <= children


def test_a_strategy_built_in_code_is_checked_too():
    with pytest.raises(UsageError) as info:
        WorkerArgs(checkpoint="c", strategy="zero3").validate()
    assert str(info.value) == "--strategy 'zero3': must be one of ddp, fsdp"
    assert WorkerArgs.parse(["--checkpoint", "c", "--strategy", "fsdp"]).strategy == "fsdp"


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_the_demo_refuses_an_unknown_strategy(tmp_path):
    lines: list[str] = []
    assert run_cli(["--strategy", "zero3", "--workdir", str(tmp_path / "run")], timeout_s=50,
                   echo=lines.append) == 2
    assert lines == [("python -m ddpguide.elastic demo: error: argument --strategy: invalid "
                      "choice: 'zero3' (choose from 'ddp', 'fsdp') (see --help)")]
    assert list(tmp_path.iterdir()) == []


# -- the demo -----------------------------------------------------------------

@pytest.mark.timeout(330)
@pytest.mark.multiprocess
def test_the_sharded_demo_reshards_at_every_change_and_runs_every_epoch_once(tmp_path):
    report_path, workdir = tmp_path / "report.json", tmp_path / "run"
    lines: list[str] = []
    # the fewest epochs the demo takes: every check holds for any
    code = run_cli(["--strategy", "fsdp", "--report", str(report_path), "--workdir", str(workdir),
                    "--epochs", str(MIN_EPOCHS)],
                   timeout_s=300, echo=lines.append)
    assert code == 0, "\n".join(lines[-40:])
    report = json.loads(report_path.read_text())
    epochs = report["settings"]["epochs"]
    assert report["finished"] and report["settings"]["strategy"] == "fsdp"
    assert report["world_sizes"] == [2, 4, 2, 2]  # the join, the departure, the crash
    # Each new group after the first loaded what the one before saved, resharded if sizes differ.
    assert [(g.get("saved_by"), g["world_size"]) for g in report["groups"]] == [
        (None, 2), (2, 4), (4, 2), (2, 2)]
    # Every epoch exactly once, in the events and in the checkpoint's history.
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    done = [e["epoch"] for e in events if e["event"] == "epoch" and e["rank"] == 0]
    assert sorted(done) == list(range(epochs)) == [e["epoch"] for e in report["epochs"]]
    # The final checkpoint, read by one process without a process group.
    model = ToyModel()
    extra = load_sharded(model, None, workdir / "checkpoint")
    assert extra["epoch"] == epochs - 1
    schedule = [h["world_size"] for h in extra["history"]]
    assert schedule == [e["world_size"] for e in report["epochs"]] and set(schedule) == {2, 4}
    reference = replay(TrainConfig(model="toy", batch_size=WorkerArgs.batch_size),
                       toy_data(WorkerArgs.samples), schedule)
    assert _close(dict(model.named_parameters()), reference) < TOLERANCE
    assert any("resharded on load: 2 -> 4 ranks, 4 -> 2 ranks" in line for line in lines)
