"""pipeline_schedules.py: every library schedule equals one process, at 2 and 4 ranks and with
FSDP2 on a 2 x 2 mesh; its refusals are the library's, one line and exit status 2."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from ddpguide.launch.programs import PROGRAMS
from ddpguide.pipeline import zoo
from tests.programs.programs_support import PYTHON, TORCHRUN, check_ok, copy_program, load_program, run
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused

LINE = re.compile(r"\[rank (\d)\] (\S+) m=(\d+) stages ([\d,]+): max gradient difference (\S+)"
                  r"(?:, loss difference (\S+))?; peak activations (\S+) chunks")
CHECK = re.compile(r"check: (\S+) on (\d) ranks x dp (\d), m=(\d+), matches one process "
                   r"within 1e-10: (OK|FAILED)")


PROGRAM_PATH = PROGRAMS / "pipeline_schedules.py"


def launch(tmp_path, nproc, *args, timeout=400):
    copy_program("pipeline_schedules.py", tmp_path)
    result = check_ok(run([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
                           "pipeline_schedules.py", *args], tmp_path, timeout=timeout))
    return result.stdout


def check_all(out, pp, dp, counts):
    """Every schedule the library accepts ran and matched; the others were skipped."""
    expected = [(s, m) for s in zoo.SCHEDULES for m in counts if zoo.library_refusal(s, pp, m) is None]
    checks = CHECK.findall(out)
    assert [(s, int(m)) for s, *_, m, _ in [(c[0], c[3], c[4]) for c in checks]] == expected
    assert all(c[1:3] == (str(pp), str(dp)) and c[4] == "OK" for c in checks)
    skipped = [(s, m) for s in zoo.SCHEDULES for m in counts if (s, m) not in expected]
    assert len(re.findall(r"^skip: ", out, re.M)) == len(skipped)
    lines = LINE.findall(out)
    assert len(lines) == len(expected) * pp * dp
    for _, schedule, _, stages, grad, loss, _ in lines:
        assert float(grad) <= 1e-10
        last = str(pp * zoo.stages_per_rank(schedule) - 1)
        assert (loss != "") == (last in stages.split(",")) and (not loss or float(loss) <= 1e-10)
    return lines


def check_memory(lines, pp):
    """Peak activations measured equal the chunks in flight counted from the action list
    (zero-bubble: at least the chunks before their I, at most those before their W plus half
    of each chunk from its W to the end of the step)."""
    for rank, schedule, m, _, _, _, peak in lines:
        counted = zoo.in_flight(schedule, pp, int(m))[int(rank)]
        if schedule in zoo.ZERO_BUBBLE:
            assert zoo.in_flight(schedule, pp, int(m), until="I")[int(rank)] <= float(peak)
            assert float(peak) <= zoo.held_until_step_end(schedule, pp, int(m))[int(rank)], (rank, schedule, m)
        else:
            assert float(peak) == counted, (rank, schedule, m)


@pytest.mark.timeout(450)
def test_every_schedule_on_2_ranks(tmp_path):
    out = launch(tmp_path, 2, "--microbatches", "3", "4", "--time", "1", "--report", "report.json")  # 3: not a multiple
    assert "skip: DualPipeV needs at least as many micro-batches as stages (4), got 3" in out
    check_memory(check_all(out, 2, 1, (3, 4)), 2)
    check_timed(json.loads((tmp_path / "report.json").read_text()), out, 2)


def check_timed(report, out, pp):
    """The timed step's spans are the action list the bubble is counted on, in the order each
    rank ran them, and the printed bubble is the one computed from them."""
    program = load_program(PROGRAM_PATH)
    printed = dict(re.findall(r"^timed: (\S+ m=\d+): .*bubble \(idle over busy, all ranks\) (\S+);", out, re.M))
    assert len(printed) == len(report["runs"])
    for done in report["runs"]:
        name, m, timed = done["schedule"], done["microbatches"], done["timed"]
        counted = zoo.compute_actions(name, pp, m)
        for rank in done["ranks"]:
            ran = [f"{stage}{kind}" for kind, stage, *_ in rank["timed"][0]["spans"]]
            assert ran == [f"{op.stage}{op.kind}" for op in counted[rank["rank"]]], (name, m, rank["rank"])
            assert all(0 <= start <= end for *_, start, end in rank["timed"][0]["spans"])
        step = program.bubble_of_step([r["timed"][0]["spans"] for r in done["ranks"]])
        assert timed["bubble"] == step["bubble"] == timed["steps"][0]["bubble"]
        assert f"{step['bubble']:.3f}" == printed[f"{name} m={m}"]
        assert timed["steps"][0]["others_on_core"] == [None, None]  # not pinned: no core to read


def test_others_on_the_core_are_read_only_where_the_rank_is_pinned():
    program = load_program(PROGRAM_PATH)
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:
        assert program.others_on_my_core() is None
    try:
        os.sched_setaffinity(0, {min(cores)})
        before = program.others_on_my_core()
        sum(i * i for i in range(200_000))  # this process's own work is not the others'
        after = program.others_on_my_core()
    finally:
        os.sched_setaffinity(0, cores)
    assert isinstance(before, float) and after - before > -0.05  # ticks of 10 ms on both counters


def test_the_bubble_of_a_step_is_idle_over_busy_from_first_compute_to_last():
    program = load_program(PROGRAM_PATH)
    # GPipe, 2 stages, one micro-batch, F = 1 and B = 2: rank 0 F 0-1, B 4-6; rank 1 F 1-2, B 2-4;
    # the clocks start 0.5 before the first compute
    step = program.bubble_of_step([[("F", 0, 0.5, 1.5), ("B", 0, 4.5, 6.5)],
                                   [("F", 1, 1.5, 2.5), ("B", 1, 2.5, 4.5)]])
    assert step == {"seconds": 6.0, "busy": [3.0, 3.0], "idle": [3.0, 3.0], "bubble": 1.0}
    timeline = zoo.simulate("GPipe", 2, 1)
    assert float(timeline.bubble) == step["bubble"]  # the count's definition, on the same timeline
    costs = program.costs_of([[("F", 0, 0.0, 1.0), ("F", 0, 1.0, 3.0), ("F", 0, 3.0, 6.0)], [("W", 1, 0.0, 0.5)]])
    assert costs == {"F0": 2.0, "W1": 0.5}


@pytest.mark.timeout(450)
def test_every_schedule_on_4_ranks(tmp_path):
    out = launch(tmp_path, 4, "--microbatches", "6", "8")  # 6: not a multiple of the ranks
    check_memory(check_all(out, 4, 1, (6, 8)), 4)


@pytest.mark.timeout(450)
def test_pipeline_times_fsdp2_on_a_2x2_mesh(tmp_path):
    out = launch(tmp_path, 4, "--dp", "2", "--schedule", "1F1B", "Interleaved1F1B",
                 "ZBVZeroBubble", "--microbatches", "4", "--report", "report.json")
    checks = CHECK.findall(out)
    assert checks == [(s, "2", "2", "4", "OK") for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")]
    lines = LINE.findall(out)
    assert len(lines) == 12 and all(float(line[4]) <= 1e-10 for line in lines)
    # the report says what the ranks printed: each rank's stages, differences and peak
    report = assert_report_agrees((json.loads((tmp_path / "report.json").read_text()), out.splitlines()))
    assert [(c["schedule"], c["microbatches"], c["ok"]) for c in report["checks"]] == [
        (s, 4, True) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")]
    printed = {(int(rank), schedule): (stages, float(grad), peak)
               for rank, schedule, _, stages, grad, _, peak in lines}
    reported = {(r["rank"], run["schedule"]): (",".join(map(str, r["stages"])),
                                                float(f"{r['max_gradient_difference']:.1e}"),
                                                f"{r['peak_activation_chunks']:g}")
                for run in report["runs"] for r in run["ranks"]}
    assert reported == printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline_schedules.py", "report.json"]
    # rank = pp rank x 2 + dp rank; both dp ranks of a stage hold the same activations
    check_memory([(str(int(rank) // 2), *rest) for rank, *rest in lines], 2)


def test_refusals_are_the_librarys(tmp_path):
    program = load_program(copy_program("pipeline_schedules.py", tmp_path))
    for schedule in zoo.SCHEDULES:
        for pp in (2, 3, 4):
            for m in range(1, 11):
                assert (program.refusal(schedule, pp, m) is None) == (
                    zoo.library_refusal(schedule, pp, m) is None), (schedule, pp, m)


REFUSALS = [
    ("2", ["--schedule", "Interleaved1F1B", "--microbatches", "5"],
     "Interleaved1F1B runs max(1, m // 2) = 2 rounds, which must divide the 5 micro-batches"),
    ("4", ["--schedule", "GPipe", "InterleavedZeroBubble", "--microbatches", "8", "9"],
     "InterleavedZeroBubble runs max(1, m // 4) = 2 rounds, which must divide the 9 micro-batches"),
    ("2", ["--schedule", "1F1B", "--microbatches", "1"],
     "1F1B needs at least as many micro-batches as ranks (2), got 1"),
    ("2", ["--schedule", "DualPipeV", "--microbatches", "3"],
     "DualPipeV needs at least as many micro-batches as stages (4), got 3"),
    ("4", ["--dp", "2", "--schedule", "DualPipeV", "--microbatches", "3"],
     "DualPipeV needs at least as many micro-batches as stages (4), got 3"),
    ("4", ["--dp", "3"], "--dp 3 leaves no pipeline of 2 ranks or more in 4 ranks"),
    ("2", ["--microbatch-size", "16"],
     "--microbatch-size must differ from --width (activations are told from weights by shape)"),
    ("2", ["--schedule", "ZB"], "argument --schedule: invalid choice: 'ZB' (choose from 'GPipe', "
     "'1F1B', 'Interleaved1F1B', 'LoopedBFS', 'InterleavedZeroBubble', 'ZBVZeroBubble', "
     "'DualPipeV', 'all')"),
    (None, [], "start me with torchrun --standalone --nproc-per-node=2 pipeline_schedules.py"),
]


def torchrun_environment(world):
    """What torchrun sets for rank 0 of ``world`` (None: started without torchrun)."""
    return None if world is None else {"WORLD_SIZE": world, "RANK": "0", "LOCAL_RANK": "0",
                                       "LOCAL_WORLD_SIZE": world}


@pytest.mark.parametrize("world, args, message", [REFUSALS[0], REFUSALS[-1]])
def test_a_refused_run_is_one_line_and_exit_2(tmp_path, world, args, message):
    copy_program("pipeline_schedules.py", tmp_path)
    result = run([PYTHON, "pipeline_schedules.py", *args], tmp_path, timeout=120,
                 env=torchrun_environment(world))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"pipeline_schedules.py: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline_schedules.py"]


def test_a_report_into_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    copy_program("pipeline_schedules.py", tmp_path)
    assert_report_into_missing_folder_refused("pipeline_schedules.py", tmp_path, torchrun_environment("2"),
                                              "pipeline_schedules.py: error: --report missing/r.json: no folder ")


def test_every_refusal_is_one_line(tmp_path, monkeypatch, capsys):
    """The same check in this process, for each refusal (a fresh interpreter costs seconds)."""
    program = load_program(copy_program("pipeline_schedules.py", tmp_path))
    monkeypatch.setattr(sys, "argv", ["pipeline_schedules.py"])
    for world, args, message in REFUSALS:
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in (torchrun_environment(world) or {}).items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stopped:
            program.parse_args(args)
        captured = capsys.readouterr()
        assert (stopped.value.code, captured.out) == (2, "")
        assert captured.err == f"pipeline_schedules.py: error: {message}\n"


def test_pin_cores_needs_a_core_per_local_rank(tmp_path, monkeypatch, capsys):
    program = load_program(copy_program("pipeline_schedules.py", tmp_path))
    monkeypatch.setattr(sys, "argv", ["pipeline_schedules.py"])
    cores = len(os.sched_getaffinity(0))
    for name, value in torchrun_environment(str(2 * cores)).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        program.parse_args(["--pin-cores"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"pipeline_schedules.py: error: --pin-cores: {2 * cores} ranks "
                                       f"on this machine, {cores} cores to pin them to\n")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # the other ranks of a 2-rank job on other machines
    assert program.parse_args(["--pin-cores"]).pin_cores
