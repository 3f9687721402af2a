"""A program's ranks forked warm stand for the command as typed: the same variables, folder,
arguments and output, a failure that stops the others, a time limit; and a command they
cannot stand for runs as typed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ddpguide.launch import forked, programs, ranks

SEES = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
seen = {key: os.environ.get(key) for key in keys}
seen.update(port=os.environ["MASTER_PORT"].isdigit(), run_id=bool(os.environ["TORCHELASTIC_RUN_ID"]),
            error_file=os.environ["TORCHELASTIC_ERROR_FILE"].endswith(f"/{dist.get_rank()}/error.json"),
            argv=sys.argv, files=sorted(os.listdir(".")), path0=sys.path[0] == os.getcwd(),
            name=__name__, threads=torch.get_num_threads(), total=total.item())
sys.stdout.write(json.dumps(seen, sort_keys=True) + "\\n")  # one write: ranks share the output
dist.destroy_process_group()
"""


STREAMS = """\
import sys
seen = [(type(s.buffer).__name__, s.write_through, s.line_buffering) for s in (sys.stdout, sys.stderr)]
sys.stdout.write(repr(seen) + "\\n")  # one write: unbuffered, print() writes the newline apart
"""


@pytest.fixture
def fake_programs(tmp_path, monkeypatch):
    folder = tmp_path / "programs"
    folder.mkdir()
    (folder / "sees.py").write_text(SEES)
    (folder / "fails.py").write_text(
        "import os, sys, time\nprint('about to fail', flush=True)\n"
        "sys.exit(3) if os.environ.get('RANK', '1') == '1' else time.sleep(600)\n")
    (folder / "raises.py").write_text("raise ValueError('a bad value')\n")
    (folder / "hangs.py").write_text("import time\nprint('hanging', flush=True)\ntime.sleep(600)\n")
    (folder / "debug.py").write_text(
        "import torch.distributed as dist\nprint(dist.get_debug_level())\n")
    monkeypatch.setattr(programs, "PROGRAMS", folder)
    return folder


def test_only_python_and_a_standalone_torchrun_can_be_forked():
    assert forked.ranks_of(("python",)) == 0
    assert forked.ranks_of(programs.torchrun(4)) == 4
    assert forked.ranks_of(("torchrun", "--nnodes=2", "--nproc-per-node=2")) is None
    assert forked.ranks_of(("torchrun", "--standalone", "--nproc-per-node=gpu")) is None
    assert forked.ranks_of(("torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=1")) is None


def _seen(launch: str) -> list[dict]:
    done = programs.run("sees.py", "--steps", "2", launcher=programs.torchrun(2), echo=False,
                        launch=launch)
    return sorted((json.loads(line) for line in done.program_lines() if line.startswith("{")),
                  key=lambda seen: seen["RANK"])


@pytest.mark.multiprocess
def test_a_forked_rank_sees_what_a_torchrun_worker_sees(fake_programs, monkeypatch):
    typed = _seen("typed")
    assert [seen["RANK"] for seen in typed] == ["0", "1"]
    assert typed[0]["argv"] == ["sees.py", "--steps", "2"] and typed[0]["total"] == 1.0
    assert _seen("warm") == typed


@pytest.mark.multiprocess
def test_one_process_forked_gets_its_arguments_its_folder_and_its_exit_status(fake_programs, monkeypatch):
    monkeypatch.setattr(programs, "LAUNCH", "warm")
    done = programs.run("fails.py", "x", expect=3, echo=False)
    assert (done.command, done.lines()) == ("python fails.py x", ["about to fail"])
    raised = programs.run("raises.py", expect=1, echo=False)
    assert raised.lines()[0] == "Traceback (most recent call last):"
    assert raised.lines()[1].startswith('  File "') and "/raises.py\", line 1" in raised.lines()[1]
    assert raised.lines()[-1] == "ValueError: a bad value"


@pytest.mark.multiprocess
def test_a_failing_rank_stops_the_others_and_the_status_is_1(fake_programs, monkeypatch):
    monkeypatch.setattr(programs, "LAUNCH", "warm")
    started = time.monotonic()
    done = programs.run("fails.py", launcher=programs.torchrun(2), expect=1, echo=False, timeout=60)
    assert time.monotonic() - started < ranks.GRACE_S + 5
    assert done.lines() == ["about to fail", "about to fail", "forked ranks: rank 1 exited with 3"]


@pytest.mark.multiprocess
def test_ranks_that_all_fail_at_once_end_with_status_1(fake_programs, monkeypatch):
    monkeypatch.setattr(programs, "LAUNCH", "warm")
    for _ in range(5):  # every rank may have exited before the first look
        done = programs.run("raises.py", launcher=programs.torchrun(2), expect=1, echo=False)
        assert done.lines()[-1].startswith("forked ranks: rank ")


@pytest.mark.multiprocess
def test_forked_ranks_past_their_time_are_killed(fake_programs, monkeypatch, capsys):
    monkeypatch.setattr(programs, "LAUNCH", "warm")
    started = time.monotonic()
    with pytest.raises(programs.ProgramTimeout, match="did not finish within 3 s"):
        programs.run("hangs.py", launcher=programs.torchrun(2), timeout=3)
    assert time.monotonic() - started < 10
    assert capsys.readouterr().out.splitlines() == [
        "$ torchrun --standalone --nproc-per-node=2 hangs.py", "hanging", "hanging"]


@pytest.mark.multiprocess
def test_a_variable_only_a_fresh_interpreter_reads_makes_the_command_run_as_typed(fake_programs, monkeypatch):
    monkeypatch.setattr(programs, "LAUNCH", "warm")
    assert programs.run("debug.py", echo=False).lines() == ["DebugLevel.OFF"]
    done = programs.run("debug.py", echo=False, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert done.lines() == ["DebugLevel.DETAIL"]


@pytest.mark.multiprocess
def test_forked_streams_are_a_fresh_interpreter_s_unbuffered_under_torchrun_as_with_python_u(tmp_path):
    (tmp_path / "streams.py").write_text(STREAMS)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}

    def typed(*launcher: str) -> list[str]:
        done = subprocess.run([*launcher, "streams.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        return [line for line in done.stdout.splitlines() if line.startswith("[")]

    torchrun = typed(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
    python = typed(sys.executable)
    assert torchrun == ["[('FileIO', True, False), ('FileIO', True, False)]"] * 2  # python -u
    assert python == ["[('BufferedWriter', False, False), ('BufferedWriter', False, True)]"]
    assert forked.run(tmp_path, ["streams.py"], 2, env, timeout=60).output.splitlines() == torchrun
    assert forked.run(tmp_path, ["streams.py"], 0, env, timeout=60).output.splitlines() == python
