"""The training command line: arguments, one-process runs, the error file of @record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide.core.runtime import DistEnv, Runtime
from ddpguide.launch.torchrun import LAUNCHER_VARIABLES, agent_environment
from ddpguide.train import cli as train_cli
from ddpguide.train.loop import TrainConfig, fit
from ddpguide.train.torchrun_demo import summarize_error

# @record installs a fault handler on stderr, which pytest's capture cannot provide
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
QUICK = ["--epochs", "1", "--max-steps-per-epoch", "20", "--lr", "0.01", "--dataset", "digits",
         "--no-eval", "--quiet"]


@pytest.fixture(autouse=True)
def no_launcher_variables(monkeypatch):
    """These tests run the CLI as one plain process, whatever launched pytest."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _main_exit(argv, capsys):
    with pytest.raises(SystemExit) as info:
        train_cli.main(argv)
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-1"], "argument --epochs: must be >= 0, got -1"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["--batch-size", "many"], "argument --batch-size: expected an integer, got 'many'"),
    (["--lr", "0"], "argument --lr: must be > 0, got 0"),
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi' (choose from auto, gloo, nccl)"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from auto, cpu, cuda)"),
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8' (choose from off, auto, bf16, fp16)"),
    (["--epochs", "2", "--crash-at-epoch", "2"], "--crash-at-epoch 2 never happens with --epochs 2"),
    (["--backend", "nccl", "--device", "cpu"], "backend 'nccl' needs device 'cuda'; use 'gloo' on CPU"),
    (["--crash-at-epoch", "0", "--crash-rank", "1"], "--crash-rank 1 is not a rank of this run (WORLD_SIZE=1)"),
])
def test_bad_arguments_exit_2_with_one_clear_line(argv, message, capsys):
    code, out, err = _main_exit(argv, capsys)
    assert code == 2 and out == ""
    # argparse quotes choices differently across Python versions: compare without quotes
    assert err.replace("'", "") == f"python -m ddpguide.train: error: {message} (see --help)\n".replace("'", "")


def test_help_explains_every_option(capsys):
    # torchrun's @record turns SystemExit(0) into a plain return (sys.exit(None) exits with 0)
    assert train_cli.main(["--help"]) is None
    out = capsys.readouterr().out
    options = [a.option_strings[-1] for a in train_cli.build_parser()._actions if a.option_strings]
    assert "--batch-size" in options and "--crash-at-epoch" in options and "--json" in options
    for option in options:
        assert option in out
    assert all(action.help for action in train_cli.build_parser()._actions)
    assert "torchrun --standalone --nproc-per-node=2 -m ddpguide.train" in out


def test_arguments_become_the_training_config():
    args = train_cli.build_parser().parse_args(
        ["--epochs", "4", "--batch-size", "16", "--lr", "0.1", "--amp", "bf16", "--sync-bn",
         "--checkpoint", "c.pt", "--max-steps-per-epoch", "7", "--no-eval", "--dataset", "digits"])
    config = train_cli.config_from_args(args)
    assert config == TrainConfig(dataset="digits", epochs=4, batch_size=16, lr=0.1, amp="bf16",
                                 sync_bn=True, checkpoint="c.pt", max_steps_per_epoch=7,
                                 evaluate=False)


@pytest.mark.timeout(120)
def test_cli_in_process_trains_exactly_like_fit(tmp_path):
    summary_path = tmp_path / "run.json"
    # on the CPU, where the same computation gives the same bits (cuDNN need not)
    argv = [*QUICK, "--max-steps-per-epoch", "5", "--seed", "3", "--device", "cpu",
            "--backend", "gloo", "--json", str(summary_path)]
    assert train_cli.main(argv) == 0
    summary = json.loads(summary_path.read_text())
    direct = fit(TrainConfig(dataset="digits", epochs=1, max_steps_per_epoch=5, lr=0.01, seed=3,
                             evaluate=False, log=False), DistEnv.single(), Runtime("gloo", "cpu"))
    assert len(summary["step_losses"]) == 5
    assert summary["step_losses"] == direct.step_losses
    assert summary["result"]["world_size"] == 1
    assert summary["config"]["seed"] == 3 and summary["config"]["max_steps_per_epoch"] == 5


def test_record_writes_the_crash_to_the_error_file(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(train_cli.DeliberateCrash, match="rank 0 crashed on purpose"):
        train_cli.main([*QUICK, "--crash-at-epoch", "0"])
    error = json.loads(error_file.read_text())
    summary = summarize_error(error)
    assert summary.exception == ("DeliberateCrash: rank 0 crashed on purpose at the start of "
                                 "epoch 0 (--crash-at-epoch)")
    assert Path(summary.file).parts[-2:] == ("train", "cli.py") and summary.function == "run"
    assert "Traceback (most recent call last)" in error["message"]["extraInfo"]["py_callstack"]


@pytest.mark.timeout(150)
def test_python_dash_m_trains_one_process_and_the_loss_falls(tmp_path):
    summary_path = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "ddpguide.train", *QUICK, "--json", str(summary_path)],
        cwd=tmp_path, env=agent_environment(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["result"]["world_size"] == 1 and summary["result"]["rank"] == 0
    assert summary["argv"] == [*QUICK, "--json", str(summary_path)]
    losses = summary["step_losses"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


@pytest.mark.timeout(60)
def test_bad_argument_from_the_real_entry_point_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddpguide.train", "--epochs", "-1"],
                          cwd=tmp_path, env=agent_environment(), capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("python -m ddpguide.train: error: argument --epochs: must be >= 0, "
                           "got -1 (see --help)\n")


def test_device_cuda_without_a_gpu_is_an_argument_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = _main_exit(["--device", "cuda"], capsys)
    assert code == 2
    assert err == ("python -m ddpguide.train: error: device 'cuda' requested but no GPU is "
                   "visible (see --help)\n")


def test_inconsistent_launcher_variables_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    code, _, err = _main_exit(QUICK, capsys)
    assert code == 2
    assert err == ("python -m ddpguide.train: error: RANK=5 must be smaller than WORLD_SIZE=2 "
                   "(see --help)\n")
