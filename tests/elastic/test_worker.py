"""The elastic worker: it reads back the command line node mode writes, and trains on
a toy problem that is the same in every process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpguide.elastic.worker import parse_args, toy_data
from ddpguide.elastic.worker_args import WorkerArgs

ROOT = Path(__file__).resolve().parents[2]


def test_the_worker_reads_back_what_node_mode_writes():
    args = WorkerArgs(checkpoint="/shared/ckpt.pt", epochs=5, events="/shared/events.jsonl",
                      step_delay=0.123456789, samples=33, batch_size=7, timeout=12.5)
    assert parse_args(args.argv()) == args
    assert parse_args(["--checkpoint", "c.pt"]) == WorkerArgs(checkpoint="c.pt")


def test_bad_worker_input_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--checkpoint", "c.pt", "--batch-size", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("python -m ddpguide.elastic.worker: error: --batch-size 0: "
                                       "must be at least 1 (see --help)\n")


@pytest.mark.timeout(60)
def test_bad_worker_input_from_a_shell(tmp_path):
    """As plain torchrun would start it: refused before torch is imported."""
    result = subprocess.run([sys.executable, "-m", "ddpguide.elastic.worker", "--checkpoint",
                             str(tmp_path / "c.pt"), "--timeout", "-1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=50, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("python -m ddpguide.elastic.worker: error: --timeout -1: must be a "
                             "number of seconds above 0, at most 604800 (see --help)\n")
    assert list(tmp_path.iterdir()) == []


def test_toy_data_is_the_same_in_every_process():
    first, again = toy_data(40), toy_data(40)
    for a, b in ((first.train, again.train), (first.test, again.test)):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    x, y = first.train.tensors
    assert x.shape == (40, 10) and y.shape == (40,) and first.test.tensors[0].shape == (128, 10)
    assert set(y.tolist()) <= set(range(5)) and len(set(y.tolist())) > 1
    # A different seed is a different problem.
    other = toy_data(40, seed=1)
    assert not torch.equal(other.train.tensors[0], x)
    assert first.name == "toy" and len(toy_data(1).train) == 1
