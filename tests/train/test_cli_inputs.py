"""``python -m ddpguide.train``: every input is checked before anything runs.

Bad input is one line on stderr naming the option and the value, exit status 2,
no training started, and the files beside it byte-for-byte unchanged. A corrupt
latest checkpoint beside a good fallback is not bad input: the run resumes from
the fallback, and the damaged file never becomes the fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ddpguide.core.checkpoint import (
    kept_aside,
    previous_path,
    save_checkpoint,
    training_state,
)
from ddpguide.core.models import ToyModel, build_model
from ddpguide.launch.torchrun import LAUNCHER_VARIABLES, agent_environment
from ddpguide.train import cli as train_cli
from ddpguide.train import cli_inputs
from tests.file_snapshot import snapshot

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
QUICK = ["--epochs", "1", "--max-steps-per-epoch", "2", "--dataset", "digits", "--no-eval",
         "--quiet"]
PROG = "python -m ddpguide.train"
WEIGHTS_ONLY = "weights-only load refused: Unsupported operand 0"


@pytest.fixture(autouse=True)
def plain_process(monkeypatch, tmp_path):
    """One plain process, run from an empty folder, whatever launched pytest."""
    for name in (*LAUNCHER_VARIABLES, "DDPGUIDE_MNIST_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def _save(path, model=None, epoch=0):
    model = model or build_model("convnet")
    save_checkpoint(training_state(epoch, model, torch.optim.SGD(model.parameters(), lr=0.1)),
                    path)


@pytest.fixture
def files(tmp_path):
    """A folder with a good checkpoint and every kind of bad one beside it."""
    _save(tmp_path / "good.pt")
    _save(tmp_path / "toy.pt", ToyModel())
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"\x00garbage" * 64)
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x\n")
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "old.json").write_text(json.dumps({"argv": [], "config": {}, "result": {}}))
    (tmp_path / "fb").mkdir()
    (tmp_path / "fb" / "ck.pt.prev").mkdir()
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


def _cases(t):
    """(argv, the message after 'argument ') for every bad input."""
    return [
        (["--checkpoint", f"{t}/a_dir"], f"--checkpoint: checkpoint {t}/a_dir is a directory"),
        (["--checkpoint", f"{t}/fifo"], f"--checkpoint: checkpoint {t}/fifo is not a regular file"),
        (["--checkpoint", f"{t}/fb/ck.pt"],
         f"--checkpoint: checkpoint fallback {t}/fb/ck.pt.prev is a directory"),
        (["--checkpoint", f"{t}/missing/ck.pt"],
         f"--checkpoint: checkpoint directory {t}/missing does not exist"),
        (["--checkpoint", f"{t}/a_file/ck.pt"],
         f"--checkpoint: checkpoint directory {t}/a_file is not a directory"),
        (["--checkpoint", f"{t}/garbage.pt"],
         f"--checkpoint: no readable checkpoint: {t}/garbage.pt: UnpicklingError: {WEIGHTS_ONLY}"),
        (["--checkpoint", f"{t}/truncated.pt"],
         f"--checkpoint: no readable checkpoint: {t}/truncated.pt: OSError: [Errno 22] Invalid "
         "argument"),
        (["--checkpoint", f"{t}/other.pt"],
         f"--checkpoint: no readable checkpoint: {t}/other.pt: CheckpointError: {t}/other.pt is "
         "not a training checkpoint (no 'epoch'/'model' entry)"),
        (["--checkpoint", f"{t}/toy.pt"],
         f"--checkpoint: checkpoint {t}/toy.pt does not fit this model: Error(s) in loading "
         'state_dict for ConvNet: Missing key(s) in state_dict: "layer1.0.weight", '
         '"layer1.0.bias", "layer1.1.weight", "layer1.1.bias", "layer1.1.running_mean", '
         '"layer1.1.running_var", "l...'),
        (["--json", f"{t}/a_dir"], f"--json: {t}/a_dir is a directory"),
        (["--json", f"{t}/fifo"], f"--json: {t}/fifo is not a regular file"),
        (["--json", f"{t}/a_file/run.json"], f"--json: {t}/a_file is not a directory"),
        (["--json", f"{t}/a_file/deeper/run.json"], f"--json: {t}/a_file is not a directory"),
        (["--json", f"{t}/notes.txt"],
         f"--json: {t}/notes.txt exists and is not a summary written by {PROG}; refusing to "
         "overwrite it"),
        (["--json", f"{t}/good.pt"],
         f"--json: {t}/good.pt exists and is not a summary written by {PROG}; refusing to "
         "overwrite it"),
        (["--checkpoint", f"{t}/good.pt", "--json", f"{t}/good.pt"],
         f"--json: {t}/good.pt is the checkpoint (--checkpoint)"),
        (["--checkpoint", f"{t}/new.pt", "--json", f"{t}/new.pt"],
         f"--json: {t}/new.pt is the checkpoint (--checkpoint)"),
        (["--checkpoint", f"{t}/new.pt", "--json", f"{t}/new.pt.prev"],
         f"--json: {t}/new.pt.prev is the checkpoint's fallback (--checkpoint)"),
        (["--json", ""], "--json: empty file name"),
        (["--checkpoint", ""], "--checkpoint: empty file name"),
        (["--dataset", "mnist"],
         "--dataset: mnist files not found under data/MNIST/raw (set DDPGUIDE_MNIST_ROOT, or "
         "use --dataset digits)"),
        (["--lr", "inf"], "--lr: must be finite, got inf"),
        (["--lr", "nan"], "--lr: must be > 0, got nan"),
        (["--timeout", "0"], "--timeout: must be > 0, got 0"),
        (["--timeout", "1e9"], "--timeout: must be <= 604800, got 1e9"),
        (["--timeout", "forever"], "--timeout: expected a number, got 'forever'"),
        (["--seed", "18446744073709551616"],
         "--seed: must be <= 18446744073709551615, got 18446744073709551616"),
        (["--seed", "-1"], "--seed: must be >= 0, got -1"),
        (["--epochs", "1.5"], "--epochs: expected an integer, got '1.5'"),
        (["--max-steps-per-epoch", "0"], "--max-steps-per-epoch: must be >= 1, got 0"),
        (["--crash-rank", "-1"], "--crash-rank: must be >= 0, got -1"),
    ]


@pytest.fixture
def no_training(monkeypatch):
    """Fail loudly if a bad input gets as far as training or the process group."""
    def started(*args, **kwargs):
        raise AssertionError("a run started despite bad input")
    monkeypatch.setattr(train_cli, "fit", started)
    monkeypatch.setattr(train_cli.process_group, "setup", started)


def test_every_bad_input_is_one_line_exit_2_and_changes_nothing(files, no_training, capsys):
    for argv, message in _cases(files):
        before = snapshot(files)
        with pytest.raises(SystemExit) as info:
            train_cli.main([*QUICK, *argv])
        out, err = capsys.readouterr()
        assert (info.value.code, out) == (2, ""), argv
        assert err == f"{PROG}: error: argument {message} (see --help)\n", argv
        assert snapshot(files) == before, argv


def test_unwritable_places_are_refused_before_training(no_training, capsys, unwritable_directory):
    directory, reason = unwritable_directory
    for argv, message in [
        (["--checkpoint", f"{directory}/ck.pt"],
         f"--checkpoint: checkpoint directory {directory} is not writable ({reason})"),
        (["--json", f"{directory}/run.json"], f"--json: cannot write in {directory} ({reason})"),
        (["--json", f"{directory}/new/run.json"], f"--json: cannot write in {directory} ({reason})"),
    ]:
        with pytest.raises(SystemExit) as info:
            train_cli.main([*QUICK, *argv])
        assert info.value.code == 2
        assert capsys.readouterr().err == f"{PROG}: error: argument {message} (see --help)\n"


def test_good_outputs_pass_the_checks_and_create_nothing(files):
    args = train_cli.build_parser().parse_args(
        [*QUICK, "--checkpoint", f"{files}/good.pt", "--json", f"{files}/new/dir/run.json"])
    before = snapshot(files)
    cli_inputs.check_inputs(args, train_cli.config_from_args(args), is_writer=True)
    args.json = f"{files}/old.json"  # a summary of an earlier run may be replaced
    cli_inputs.check_inputs(args, train_cli.config_from_args(args), is_writer=True)
    assert snapshot(files) == before


def test_a_checkpoint_from_another_model_is_refused_even_where_only_read(files):
    args = train_cli.build_parser().parse_args([*QUICK, "--checkpoint", f"{files}/toy.pt"])
    with pytest.raises(ValueError, match="does not fit this model"):
        cli_inputs.check_inputs(args, train_cli.config_from_args(args), is_writer=False)


@pytest.mark.timeout(150)
def test_a_corrupt_checkpoint_resumes_from_the_fallback_and_never_becomes_it(tmp_path, capsys):
    """The good fallback survives the run: the damaged file is kept aside, not rotated."""
    path = tmp_path / "ck.pt"
    _save(path, epoch=0)
    _save(path, epoch=1)
    good_fallback = previous_path(path).read_bytes()
    path.write_bytes(b"\x00garbage" * 64)
    with pytest.warns(RuntimeWarning) as record:
        assert train_cli.main([*QUICK, "--epochs", "2", "--checkpoint", str(path)]) == 0
    (aside,) = kept_aside(path)
    assert aside.read_bytes() == b"\x00garbage" * 64
    assert previous_path(path).read_bytes() == good_fallback
    assert torch.load(path, weights_only=True)["epoch"] == 1  # resumed after epoch 0, ran 1
    messages = [str(w.message) for w in record if "ck.pt" in str(w.message)]
    assert any("trying the previous one" in m for m in messages)
    assert f"checkpoint {path} is unreadable (UnpicklingError): kept as {aside}, not as the fallback " \
           f"({previous_path(path)} is unchanged)" in messages


@pytest.mark.timeout(120)
def test_the_real_entry_point_refuses_a_corrupt_checkpoint_in_one_line(files):
    before = snapshot(files)
    done = subprocess.run([sys.executable, "-m", "ddpguide.train", *QUICK, "--checkpoint",
                           f"{files}/garbage.pt"], cwd=files, env=agent_environment(),
                          capture_output=True, text=True, timeout=100)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"{PROG}: error: argument --checkpoint: no readable checkpoint: "
                           f"{files}/garbage.pt: UnpicklingError: {WEIGHTS_ONLY} (see --help)\n")
    assert snapshot(files) == before
