"""elastic_train.py: its input checks, its held-back SIGTERM and its error file.

A second agent joining mid-run (every epoch once, world size 1 -> 2), with the reader's
command on the package's runner, is ``tests/elastic/test_program.py``; a node lost by its
link is ``tests/cluster/test_nodes.py``.
"""

from __future__ import annotations

import json
import signal

import pytest
import torch

from tests.programs.programs_support import PYTHON, TORCHRUN, copy_program, parse_error, run


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "argument --epochs: expected a value > 0, got 0"),
    (["--timeout", "nan"], "argument --timeout: expected a value > 0, got nan"),
    (["--epoch-log", "no/such/folder/log.jsonl"],
     "argument --epoch-log: cannot write a file at 'no/such/folder/log.jsonl'"),
    ([], "RANK is not set: start me with "
         "torchrun --standalone --nproc-per-node=2 elastic_train.py"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys,
                                                         args, message):
    path = copy_program("elastic_train.py", tmp_path)
    stderr = parse_error(path, args, monkeypatch, capsys)
    assert stderr == f"elastic_train.py: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic_train.py"]


def test_sigterm_waits_for_the_commit_and_then_stops_the_worker(tmp_path):
    path = copy_program("elastic_train.py", tmp_path)
    script = (
        "import importlib.util, os, signal, time\n"
        f"spec = importlib.util.spec_from_file_location('program', {str(path)!r})\n"
        "program = importlib.util.module_from_spec(spec); spec.loader.exec_module(program)\n"
        "with program.sigterm_held_back():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # as torchrun stops a worker\n"
        "    time.sleep(0.2)\n"
        "    print('commit finished', flush=True)\n"
        "print('went on after the commit', flush=True)\n"
    )
    result = run([PYTHON, "-c", script], tmp_path, timeout=60)
    assert (result.returncode, result.stdout) == (-signal.SIGTERM, "commit finished\n")


@pytest.mark.timeout(150)
def test_a_worker_exception_reaches_the_error_file_through_record(tmp_path):
    # a checkpoint that passes the start-up check but not load_state_dict: the worker raises
    path = copy_program("elastic_train.py", tmp_path)
    wrong = {"epoch": 0, "model": {"net1.weight": torch.zeros(3, 3)}, "optimizer": {}}
    torch.save(wrong, tmp_path / "wrong.pt")
    root_cause = tmp_path / "root_cause.json"
    result = run([TORCHRUN, "--standalone", "--nproc-per-node=1", path.name,
                  "--checkpoint", "wrong.pt"], tmp_path, timeout=120,
                 env={"TORCHELASTIC_ERROR_FILE": str(root_cause)})
    assert result.returncode != 0
    # @record wrote the worker's exception; the agent copied it into its own error file
    message = json.loads(root_cause.read_text())["message"]
    assert message["message"].startswith("RuntimeError: Error(s) in loading state_dict for ToyModel")
    assert "elastic_train.py" in message["extraInfo"]["py_callstack"]
    assert "in main" in message["extraInfo"]["py_callstack"]
