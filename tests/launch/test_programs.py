"""Showing and running the book's programs from a chapter: bounded, in a folder of their own."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from ddpguide.launch import programs


def sleeper(folder) -> str:
    """The code of the child that hangs.py starts, marked with the test's own folder."""
    return f"import time; time.sleep(600)  # {folder}"


@pytest.fixture
def fake_programs(tmp_path, monkeypatch):
    folder = tmp_path / "programs"
    folder.mkdir()
    (folder / "hello.py").write_text(
        "import os, sys\nprint('args', sys.argv[1:])\nprint('files', sorted(os.listdir('.')))\n")
    (folder / "hello2.py").write_text(
        "import os, sys\nprint('args', sys.argv[1:], 'again')\nprint('files', sorted(os.listdir('.')))\n")
    (folder / "fails.py").write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    (folder / "hangs.py").write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {sleeper(folder)!r}],"
        " start_new_session=True)\n"
        "print('child', child.pid, flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(programs, "PROGRAMS", folder)
    return folder


@pytest.mark.typed
@pytest.mark.multiprocess
def test_a_program_runs_alone_in_a_fresh_folder_with_the_readers_command(fake_programs, capsys):
    done = programs.run("hello.py", "--epochs", "2")
    assert done.command == "python hello.py --epochs 2"
    assert done.lines() == ["args ['--epochs', '2']", "files ['hello.py']"]
    assert capsys.readouterr().out.splitlines()[0] == "$ python hello.py --epochs 2"


@pytest.mark.typed
@pytest.mark.multiprocess
def test_an_unexpected_exit_status_raises_with_the_output(fake_programs):
    with pytest.raises(programs.ProgramFailed, match=r"`python fails.py` exited with 3 "
                                                     r"\(expected 0\):\nabout to fail"):
        programs.run("fails.py", echo=False)
    assert programs.run("fails.py", expect=3, echo=False).returncode == 3


@pytest.mark.timeout(60)
@pytest.mark.typed
@pytest.mark.multiprocess
def test_a_program_past_its_time_is_killed_with_everything_it_started(fake_programs):
    started = time.monotonic()
    with pytest.raises(programs.ProgramTimeout, match="did not finish within 3 s"):
        programs.run("hangs.py", timeout=3, echo=False)
    assert time.monotonic() - started < 20
    orphans = [p for p in psutil.process_iter(["cmdline"])  # the child this test's program started
               if p.info["cmdline"] and sleeper(fake_programs) in p.info["cmdline"] and p.pid != os.getpid()]
    assert orphans == []


def test_the_diff_between_two_programs_is_computed(fake_programs):
    text = programs.diff("hello.py", "hello2.py")
    assert text.splitlines()[:2] == ["--- hello.py", "+++ hello2.py"]
    assert "-print('args', sys.argv[1:])" in text
    assert "+print('args', sys.argv[1:], 'again')" in text


def test_an_unknown_program_is_named(fake_programs):
    with pytest.raises(FileNotFoundError, match="no program 'nope.py'"):
        programs.show("nope.py")


@pytest.mark.multiprocess
def test_text_leaves_out_torchruns_own_log_lines(fake_programs):
    (fake_programs / "checks.py").write_text(
        "import sys\n"
        "print('W1201 04:53:33.603000 6362 torch/distributed/run.py:982] *****', file=sys.stderr)\n"
        "print('*' * 41)\n"
        "print('Setting OMP_NUM_THREADS environment variable for each process to be 1')\n"
        "print('*' * 41)\n"
        "print('  check: shards add up: OK')\nprint('plain line')\nprint('check: all equal: FAILED')\n")
    done = programs.run("checks.py", echo=False)
    assert done.text().splitlines()[:4] == ["$ python checks.py", "  check: shards add up: OK",
                                            "plain line", "check: all equal: FAILED"]
    assert done.text().splitlines()[-1].startswith("(exit status 0, ")
    assert len(done.lines()) == 7


def test_the_torchrun_launcher_is_the_readers_command():
    assert programs.torchrun(4) == ("torchrun", "--standalone", "--nproc-per-node=4")
    with pytest.raises(ValueError, match="nproc must be >= 1, got 0"):
        programs.torchrun(0)


def test_loading_a_program_leaves_the_default_dtype_as_it_was():
    import torch

    assert "torch.set_default_dtype(torch.float64)" in programs.path_of("fsdp2.py").read_text()
    before = torch.get_default_dtype()
    module = programs.load("fsdp2.py")
    assert torch.get_default_dtype() == before == torch.float32
    assert hasattr(module, "main")


def test_a_loaded_program_imports_its_neighbour_afresh_and_leaves_the_path_as_it_was(tmp_path):
    import sys

    (tmp_path / "neighbour.py").write_text("VALUE = 1\n")
    (tmp_path / "main_part.py").write_text("import neighbour\n\nVALUE = neighbour.VALUE + 1\n")
    path = list(sys.path)
    assert programs.load(tmp_path / "main_part.py").VALUE == 2
    (tmp_path / "neighbour.py").write_text("VALUE = 10\n")
    assert programs.load(tmp_path / "main_part.py").VALUE == 11  # the edit seen, no cached neighbour
    assert sys.path == path and "neighbour" not in sys.modules
    (tmp_path / "main_part.py").write_text("import neighbour\nraise RuntimeError('planted')\n")
    with pytest.raises(RuntimeError, match="planted"):
        programs.load(tmp_path / "main_part.py")
    assert sys.path == path and "neighbour" not in sys.modules
    step = programs.load("plan_step.py")  # the chapter's two programs: the formulas come with the step
    assert step.plan_cost.__file__ == str(programs.path_of("plan_cost.py"))
    assert hasattr(programs.load("gpt/train.py"), "main")  # it imports its four neighbours by bare name


def test_an_edited_copy_replaces_the_text_and_refuses_an_edit_that_misses(tmp_path):
    from ddpguide.launch.programs import path_of
    from tests.edited_programs import edited_copy

    line = "def cleanup():"
    copy = edited_copy("ddp_spawn.py", tmp_path / "a", (line, "def cleanup_edited():"))
    assert copy.read_text() == path_of("ddp_spawn.py").read_text().replace(line, "def cleanup_edited():")
    with pytest.raises(ValueError, match=r"ddp_spawn.py: 'no such line' occurs 0 times, not 1"):
        edited_copy("ddp_spawn.py", tmp_path / "b", ("no such line", "x"))
