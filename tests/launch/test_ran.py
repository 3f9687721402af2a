"""Which programs ran as a reader types them (``ddpguide.launch.ran``): the runner records
(``ddpguide.launch.starts``) every command it execs while ``DDPGUIDE_RAN`` names a folder,
and the check names a program that never ran with its ``Run:`` line's command, or ran only
with other words. The ranks run ``true`` in front of the command (a prefix, which is not
recorded), so that nothing heavier than ``true`` starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide.launch import programs, ran, ranks, starts
from ddpguide.launch.programs import copy_program

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture
def records(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "ran"
    monkeypatch.setenv(starts.RAN_VARIABLE, str(folder))
    return folder


def start(name: str, argv: list[str], folder: Path, env: dict[str, str] | None = None,
          absolute: bool = True) -> None:
    """``argv`` with the copy of program ``name`` in ``folder`` for ``{}``, through the runner."""
    copy = copy_program(name, folder)
    path = str(copy) if absolute else copy.name
    ended = ranks.run([ranks.Command([w.replace("{}", path) for w in argv], env or {}, cwd=folder,
                                     prefix=["true"])], 30)
    assert ended.returncodes == [0]


def test_a_start_as_typed_is_recorded_and_passes_the_check(records, tmp_path):
    # the runner's own --log-dir (first, outside the folder), an absolute path
    start("ddp_torchrun.py", [*TORCHRUN, "--log-dir", str(tmp_path / "agent" / "logs"), "--standalone",
                              "--nproc-per-node=2", "{}"], tmp_path / "a")
    [line] = ran.records(records)
    assert (line["program"], line["words"], line["cwd"]) == (
        "ddp_torchrun.py", ["torchrun", "--standalone", "--nproc-per-node", "2", "ddp_torchrun.py"],
        str(tmp_path / "a"))
    assert line["by"].startswith("tests/launch/test_ran.py::test_a_start_as_typed_is_recorded")
    assert ran.not_run_as_typed(records, ["ddp_torchrun.py"]) == []


def test_ports_and_paths_outside_the_folder_are_normalised_and_nothing_else():
    assert starts.words(["torchrun", "--rdzv-endpoint=node0:41234", "--standalone", "/tmp/x/train.py",
                      "--report", "/tmp/x/out/r.json", "--save", "/elsewhere/ckpt", "--lr=0.1"],
                     "/tmp/x", "/tmp/x/train.py") == [
        "torchrun", "--rdzv-endpoint", "node0:PORT", "--standalone", "train.py", "--report", "out/r.json",
        "--save", "ckpt", "--lr", "0.1"]


def test_the_reader_s_own_log_dir_and_variables_count(records, tmp_path):
    crash = [*TORCHRUN, "--log-dir", "/elsewhere/logs", "--standalone", "--nproc-per-node", "2", "--log-dir",
             "LOGS", "--redirects", "3", "--tee", "1", "--local-ranks-filter", "1", "{}"]
    start("debug/crashing_worker.py", [w.replace("LOGS", "other") for w in crash], tmp_path / "b")
    assert ran.not_run_as_typed(records, ["debug/crashing_worker.py"]) != []
    # the reader's own --log-dir, after the runner's, counts wherever it lies
    start("debug/crashing_worker.py", [w.replace("LOGS", str(tmp_path / "logs")) for w in crash], tmp_path / "c")
    assert ran.not_run_as_typed(records, ["debug/crashing_worker.py"]) == []
    typed = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "{}"]
    start("debug/desync.py", typed, tmp_path / "d", {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "d" / "frx")})
    [problem] = ran.not_run_as_typed(records, ["debug/desync.py"])
    assert problem == ("debug/desync.py: never ran as its Run: line types it (TORCH_FR_DUMP_TEMP_FILE=fr/rank_ "
                       "torchrun --standalone --nproc-per-node 2 desync.py); it ran as: TORCH_FR_DUMP_TEMP_FILE=frx "
                       "torchrun --standalone --nproc-per-node 2 desync.py")
    start("debug/desync.py", typed, tmp_path / "e", {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "e" / "fr" / "rank_")})
    assert ran.not_run_as_typed(records, ["debug/desync.py"]) == []


def test_a_program_never_run_or_run_with_other_words_is_named(records, tmp_path, capsys):
    start("ring_allreduce.py", [sys.executable, "{}", "--world-size", "4"], tmp_path / "f")
    assert ran.not_run_as_typed(records, ["ring_allreduce.py", "zero1.py"]) == [
        "ring_allreduce.py: never ran as its Run: line types it (python ring_allreduce.py); "
        "it ran as: python ring_allreduce.py --world-size 4",
        "zero1.py: never ran as its Run: line types it (torchrun --standalone --nproc-per-node 2 "
        "zero1.py); it never ran"]
    assert ran.main([str(records)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert "ring_allreduce.py: never ran as its Run: line types it (python ring_allreduce.py); " \
           "it ran as: python ring_allreduce.py --world-size 4" in err
    assert err[-1].startswith("1 program starts recorded; ") and err[-1].endswith(" program(s) never ran as typed")
    assert ran.main([str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == ("usage: python -m ddpguide.launch.ran FOLDER (the folder DDPGUIDE_RAN "
                                       f"named): no folder {tmp_path / 'none'}\n")


def test_an_edited_copy_is_no_start_of_the_program_and_nothing_is_written_without_the_variable(
        records, tmp_path, monkeypatch):
    edited = copy_program("ring_allreduce.py", tmp_path / "g")
    edited.write_text(edited.read_text() + "\n")
    ranks.run([ranks.Command([sys.executable, str(edited)], cwd=edited.parent, prefix=["true"])], 30)
    [written] = records.iterdir()
    assert len(written.read_text().splitlines()) == 1 and ran.records(records) == []
    monkeypatch.delenv(starts.RAN_VARIABLE)
    start("ring_allreduce.py", [sys.executable, "{}"], tmp_path / "h")
    assert list(records.iterdir()) == [written] and len(written.read_text().splitlines()) == 1


def test_the_run_line_runs_typed_under_typed_once_whatever_ran_before(monkeypatch, tmp_path):
    monkeypatch.setattr(programs, "TYPED", {"ddp_spawn.py"})  # it has run typed once already
    monkeypatch.setattr(programs, "RUN_LINES", set())
    assert programs.launch_of("ddp_spawn.py", "typed-once") == "warm"
    assert programs.launch_of("ddp_spawn.py", "typed-once", run_line=True) == "typed"
    programs.RUN_LINES.add("ddp_spawn.py")
    assert programs.launch_of("ddp_spawn.py", "typed-once", run_line=True) == "warm"
    assert programs.launch_of("ddp_spawn.py", "warm", run_line=True) == "warm"
    spawn = programs.path_of("ddp_spawn.py")
    assert starts.is_run_line(spawn, ["python", "ddp_spawn.py"], {}, str(tmp_path))
    assert not starts.is_run_line(spawn, ["python", "ddp_spawn.py", "--epochs", "1"], {}, str(tmp_path))
    desync, typed = programs.path_of("debug/desync.py"), ["torchrun", "--standalone", "--nproc-per-node=2", "desync.py"]
    assert starts.is_run_line(desync, typed, {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/fr/rank_"}, str(tmp_path))
    assert not starts.is_run_line(desync, typed, {}, str(tmp_path))


def test_an_added_report_file_is_still_the_run_line_and_nothing_else_added_is(records, tmp_path):
    typed = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "{}"]
    start("ddp_torchrun.py", [*typed, "--report", "x.json", "--epochs", "1"], tmp_path / "a")
    start("ddp_torchrun.py", [*typed, "--out", "x.json"], tmp_path / "b")
    start("ddp_torchrun.py", [*typed, "--report", "x.json", "--report", "y.json"], tmp_path / "c")
    start("ddp_torchrun.py", [TORCHRUN[0], "-m", "torch.distributed.run", "--report", "x.json",
                              "--standalone", "--nproc-per-node=2", "{}"], tmp_path / "d")
    [problem] = ran.not_run_as_typed(records, ["ddp_torchrun.py"])
    assert problem.startswith("ddp_torchrun.py: never ran as its Run: line types it (torchrun --standalone "
                              "--nproc-per-node 2 ddp_torchrun.py); it ran as: ")
    start("ddp_torchrun.py", [*typed, "--report", "x.json"], tmp_path / "e")
    assert ran.not_run_as_typed(records, ["ddp_torchrun.py"]) == []
    spawn = programs.path_of("ddp_spawn.py")
    assert starts.is_run_line(spawn, ["python", "ddp_spawn.py", "--report=out/x.json"], {}, str(tmp_path))
    for added in (["--report", "x.json", "--epochs", "1"], ["--epochs", "1", "--report", "x.json"],
                  ["--report"], ["--out", "x.json"]):
        assert not starts.is_run_line(spawn, ["python", "ddp_spawn.py", *added], {}, str(tmp_path)), added
    assert starts.without_report(["python", "a.py", "--lr", "1", "--report", "r.json"], "a.py") == [
        "python", "a.py", "--lr", "1"]


def test_make_test_ends_with_the_check_which_fails_on_a_program_that_never_ran_as_typed(records, tmp_path):
    make = ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}"]
    planned = subprocess.run([*make, "-n", "test"], capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.splitlines()[-1] == f"{tmp_path / 'venv'}/bin/python -m ddpguide.launch.ran {ROOT}/_build/ran"
    # the planted failure: ring_allreduce.py ran, but only with another option than its Run: line's
    start("ring_allreduce.py", [sys.executable, "{}", "--world-size", "4", "--report", "r.json"], tmp_path / "f")
    check = subprocess.run([*make, f"PY={sys.executable}", f"RAN={records}", "ran-check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 2  # make's own status when a step fails: `make test` fails
    assert ("ring_allreduce.py: never ran as its Run: line types it (python ring_allreduce.py); it ran as: "
            "python ring_allreduce.py --world-size 4 --report r.json") in check.stderr.splitlines()
    assert "1 program starts recorded; " in check.stderr
