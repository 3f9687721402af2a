"""The debugging chapter's bug programs: each one is caught the way the chapter says.

All programs run once (each bounded by its own short process-group timeout, all of
them by the launch's time limit); the tests then read what each run printed and left
behind. The runs whose check reads torchrun's own report, or that set a variable only a
fresh interpreter reads, run under torchrun, side by side, and so does each program's
first run; the others run meanwhile, side by side too, on ranks forked from the warm
server with the variables torchrun gives its workers (``ddpguide.launch.forked``), which
spares the machine a dozen more interpreters starting at once.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from ddpguide.core.runtime import LAUNCHER_VARIABLES
from ddpguide.doctor.stacks import dump_stack, find_workers
from ddpguide.launch import forked, programs, warm
from ddpguide.launch.torchrun import Agent, AgentRun, run_agents

PROGRAMS = Path(__file__).resolve().parents[2] / "book" / "programs" / "debug"
LAUNCHER = ("--standalone", "--nproc-per-node=2")
TIMED_OUT = "Timed out waiting 5000ms for recv operation to complete"
DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def agent(name: str, program: str, args=(), env=None, options=()) -> Agent:
    # torchrun starts each worker with python -u: the programs write each line in one piece
    return Agent(name, LAUNCHER + tuple(options), str(PROGRAMS / program), tuple(args), env or {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every program of the chapter except the deadlock, run once: name -> AgentRun."""
    folder = tmp_path_factory.mktemp("debug-programs")
    agents = [
        agent("shape", "wrong_shape.py"),
        agent("shape detail", "wrong_shape.py", env=DETAIL),
        agent("skip", "skipped_collective.py"),
        agent("skip detail", "skipped_collective.py", env=DETAIL),
        agent("missing", "missing_rank.py"),
        replace(agent("desync", "desync.py", env={"TORCH_FR_DUMP_TEMP_FILE": f"{folder}/fr/rank_"}),
                cwd=str(folder)),  # its Run: line, typed in folder ($PWD/fr/rank_)
        agent("desync fr2", "desync.py", env={"TORCH_FR_DUMP_TEMP_FILE": f"{folder}/fr2/rank_",
                                              "TORCH_FR_BUFFER_SIZE": "2"}),
        agent("desync fr0", "desync.py", env={"TORCH_FR_DUMP_TEMP_FILE": f"{folder}/fr0/rank_",
                                              "TORCH_FR_BUFFER_SIZE": "0"}),
        agent("unused", "ddp_unused_parameter.py"),
        agent("unused info", "ddp_unused_parameter.py", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}),
        agent("unused detail", "ddp_unused_parameter.py", env=DETAIL),
        agent("find unused", "ddp_unused_parameter.py", ["--find-unused-parameters"]),
        agent("static graph", "ddp_unused_parameter.py", ["--static-graph"]),
        agent("one rank", "ddp_forward_on_one_rank.py"),
        agent("uneven", "ddp_uneven_inputs.py"),
        agent("uneven join", "ddp_uneven_inputs.py", ["--join"]),
        agent("crash", "crashing_worker.py", env={"TORCHELASTIC_ERROR_FILE": f"{folder}/root_cause.json"},
              options=["--log-dir", str(folder / "logs"), "--redirects", "3", "--tee", "1",
                       "--local-ranks-filter", "1"]),
    ]
    # "crash": its test reads the files of torchrun's --log-dir and its report of the failure
    typed = [a for a in agents if a.name == "crash" or not forks(a)]
    for a in agents:  # every program's ranks go through interpreter teardown at least once
        if Path(a.module).name not in {Path(t.module).name for t in typed}:
            typed.append(a)
    done: list[AgentRun] = []
    thread = threading.Thread(target=lambda: done.extend(
        run_agents(typed, timeout=280, raise_on_timeout=False, failure_grace_s=280)))
    thread.start()
    try:
        forked = [a for a in agents if a not in typed]
        if forked:
            warm.context(os.environ)  # the warm server up once, before its runs start side by side
        with ThreadPoolExecutor(max(1, len(forked))) as pool:  # most of them wait for a timeout
            results = dict(zip([a.name for a in forked], pool.map(
                lambda a: forked_run(a, folder / "forked" / a.name), forked)))
    finally:
        thread.join(300)
    assert not thread.is_alive() and len(done) == len(typed)
    results.update({run.agent.name: run for run in done})
    results["folder"] = folder
    return results


def forks(spec: Agent) -> bool:
    """Whether forked ranks can stand for the agent's command: no launcher option beyond
    the two ranks, no variable that only a fresh interpreter reads."""
    return (spec.torchrun_args == LAUNCHER and programs.LAUNCH != "typed"
            and warm.start_method(environment(spec)) == "forkserver")


def environment(spec: Agent) -> dict[str, str]:
    """The environment of the agent's command, typed in this process's shell."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}, **spec.env}


def forked_run(spec: Agent, folder: Path) -> AgentRun:
    """The agent's program, copied alone into ``folder``, on two forked ranks."""
    folder.mkdir(parents=True)
    shutil.copy(spec.module, folder)
    started = time.monotonic()
    end = forked.run(folder, [Path(spec.module).name, *spec.module_args], 2, environment(spec), timeout=120)
    assert end is not None, spec.name
    return AgentRun(spec, None if end.timed_out else end.returncode, end.output,
                    time.monotonic() - started, "forked")


def rank_lines(run, rank: int) -> list[str]:
    return [line for line in run.lines() if line.startswith(f"[rank {rank}]")]


def last(run, rank: int) -> str:
    lines = rank_lines(run, rank)
    assert lines, run.output[-3000:]
    return lines[-1]


def line_number(program: str, text: str) -> int:
    lines = (PROGRAMS / program).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_every_program_imports_only_torch_and_the_standard_library():
    allowed = {"argparse", "datetime", "os", "sys", "time", "torch"}
    for program in PROGRAMS.glob("*.py"):
        imported = {line.split()[1].split(".")[0] for line in program.read_text().splitlines()
                    if line.startswith(("import ", "from "))}
        assert imported <= allowed, (program.name, imported - allowed)


@pytest.mark.multiprocess
def test_wrong_shape_times_out_and_detail_names_op_shapes_and_ranks(runs):
    plain = runs["shape"]
    assert plain.returncode == 1
    assert TIMED_OUT in last(plain, 0)
    returned = rank_lines(plain, 1)[0]  # rank 1's all-reduce returned, with a wrong sum
    assert returned.startswith("[rank 1] all_reduce returned") and "[2.0, 2.0, 2.0]" not in returned
    detail = runs["shape detail"]
    for rank, mine, theirs in ((0, 4, 3), (1, 3, 4)):
        message = last(detail, rank)
        assert "RuntimeError after" in message and "Detected mismatch between collectives on ranks." in message
        assert (f"Rank {rank} is running collective: CollectiveFingerPrint(SequenceNumber=0, "
                f"OpType=ALLREDUCE, TensorShape=[{mine}]") in message
        assert (f"but Rank {1 - rank} is running collective: CollectiveFingerPrint(SequenceNumber=0, "
                f"OpType=ALLREDUCE, TensorShape=[{theirs}]") in message
        assert f"Tensor Tensor shapes: {mine}vs {theirs}" in message


@pytest.mark.multiprocess
def test_skipped_collective_times_out_and_detail_describes_each_rank(runs):
    plain = runs["skip"]
    assert plain.returncode == 1
    assert TIMED_OUT in last(plain, 0) + last(plain, 1)
    detail = runs["skip detail"]
    assert ("Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, "
            "TensorShape=[1]") in last(detail, 0)
    assert "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=2OpType=BARRIER)" in last(detail, 1)
    # what each rank says about the other is not what the other runs (the chapter says so)
    assert "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0OpType=REDUCE)" in last(detail, 0)
    assert "but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0OpType=GATHER)" in last(detail, 1)


@pytest.mark.multiprocess
def test_monitored_barrier_names_the_missing_rank(runs):
    missing = runs["missing"]
    assert missing.returncode == 1
    assert last(missing, 0).endswith("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms")
    assert rank_lines(missing, 1) == ["[rank 1] loading a shard that never comes..."]


@pytest.mark.multiprocess
def test_flight_records_show_where_the_ranks_parted(runs):
    assert runs["desync"].returncode == 1
    records = {r: pickle.loads((runs["folder"] / "fr" / f"rank_{r}").read_bytes()) for r in (0, 1)}
    sequences = {r: [(e["collective_seq_id"], e["profiling_name"], e["input_sizes"]) for e in rec["entries"]]
                 for r, rec in records.items()}
    assert sequences[0] == [(1, "gloo:all_reduce", [[4]]), (2, "gloo:all_reduce", [[1]]),
                            (3, "gloo:all_reduce", [[4]]), (4, "gloo:all_reduce", [[1]]),
                            (5, "gloo:all_reduce", [[4]])]
    assert sequences[1] == [(1, "gloo:all_reduce", [[4]]), (2, "gloo:all_reduce", [[1]]),
                            (3, "gloo:all_reduce", [[4]]), (4, "gloo:all_reduce", [[4]])]
    frame = next(f for f in records[0]["entries"][3]["frames"] if f["filename"].endswith("desync.py"))
    assert frame["line"] == line_number("desync.py", "dist.all_reduce(loss)")
    assert {e["state"] for rec in records.values() for e in rec["entries"]} == {"scheduled"}


@pytest.mark.multiprocess
def test_flight_recorder_size_is_torch_fr_buffer_size(runs):
    def sequence_ids(folder: str, rank: int) -> list[int]:
        record = pickle.loads((runs["folder"] / folder / f"rank_{rank}").read_bytes())
        return [e["collective_seq_id"] for e in record["entries"]]
    assert (sequence_ids("fr2", 0), sequence_ids("fr2", 1)) == ([4, 5], [3, 4])  # the last two
    assert (sequence_ids("fr0", 0), sequence_ids("fr0", 1)) == ([], [])          # off


def failed_ranks(run) -> list[int]:
    """The ranks that printed their RuntimeError. The ranks share no collective before the
    error, so the first to fail can be stopped with the other still in step 0."""
    return [rank for rank in (0, 1) if any(" RuntimeError: " in line for line in rank_lines(run, rank))]


@pytest.mark.multiprocess
def test_unused_parameter_error_names_them_and_both_fixes_train(runs):
    plain = runs["unused"]
    assert plain.returncode == 1 and failed_ranks(plain)
    assert "Expected to have finished reduction in the prior iteration before starting a new one" in plain.output
    for rank in failed_ranks(plain):
        assert f"Parameter indices which did not receive grad for rank {rank}: 4 5" in plain.output
    assert "you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL" in plain.output
    assert "Parameters which did not receive grad" not in plain.output
    info = runs["unused info"]
    assert info.returncode == 1 and failed_ranks(info)
    for rank in failed_ranks(info):
        assert (f"Parameters which did not receive grad for rank {rank}: auxiliary.bias, auxiliary.weight"
                in info.output)
        assert f"Parameter indices which did not receive grad for rank {rank}: 4 5" in info.output
        steps = [line for line in rank_lines(info, rank) if " step " in line]
        assert len(steps) == 1 and steps[0].startswith(f"[rank {rank}] step 0: loss ")  # fails in step 1
    detail = runs["unused detail"]  # torch 2.14.1, CPU: DDP's constructor crashes under DETAIL
    assert detail.returncode == 1 and "exitcode  : -11" in detail.output and "(SIGSEGV)" in detail.output
    assert not rank_lines(detail, 0) and not rank_lines(detail, 1)
    for name in ("find unused", "static graph"):
        run = runs[name]
        assert run.returncode == 0, run.output[-2000:]
        for rank in (0, 1):
            assert last(run, rank) == f"[rank {rank}] the ranks' classifier weights are identical: True"
            assert len(rank_lines(run, rank)) == 4


@pytest.mark.multiprocess
def test_forward_on_one_rank_hangs_in_backward_until_the_timeout(runs):
    run = runs["one rank"]
    assert run.returncode == 1
    assert rank_lines(run, 0)[0] == "[rank 0] forward done, starting backward"
    assert "[rank 0] backward done" not in rank_lines(run, 0)
    assert TIMED_OUT in last(run, 0) + last(run, 1)


@pytest.mark.multiprocess
def test_uneven_inputs_hang_and_join_fixes_them(runs):
    run = runs["uneven"]
    assert run.returncode == 1
    assert "[rank 0] trained on all 3 of my batches" in rank_lines(run, 0)
    assert TIMED_OUT in last(run, 0) + last(run, 1)
    joined = runs["uneven join"]
    assert joined.returncode == 0
    assert "[rank 1] trained on all 5 of my batches" in rank_lines(joined, 1)
    assert all(last(joined, rank).startswith(f"[rank {rank}] done after") for rank in (0, 1))


@pytest.mark.multiprocess
def test_crashing_worker_leaves_its_traceback_and_torchrun_names_the_root_cause(runs):
    run, folder = runs["crash"], runs["folder"]
    assert run.returncode == 1
    console = run.lines()
    assert [line for line in console if line.startswith("[default")] == [
        "[default1]:[rank 1] started (this goes to stdout)"]
    files = {str(p.relative_to(folder / "logs")).split("/", 1)[1]: p
             for p in (folder / "logs").rglob("*") if p.is_file()}
    assert {f"attempt_0/1/{name}" for name in ("error.json", "stderr.log", "stdout.log")} <= set(files)
    assert files["attempt_0/1/stdout.log"].read_text() == "[rank 1] started (this goes to stdout)\n"
    assert "[rank 1] a warning (this goes to stderr)" in files["attempt_0/1/stderr.log"].read_text()
    root = console[console.index("Root Cause (first observed failure):"):]
    assert "  rank      : 1 (local_rank: 1)" in root
    assert "  ValueError: batch 3 of rank 1 has no labels" in root
    assert run.root_cause["message"]["message"] == "ValueError: batch 3 of rank 1 has no labels"
    # without @record there is no error file: every other program shows torchrun's hint instead
    assert runs["shape detail"].launch_id != "forked"  # torchrun's own report
    assert ("traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
            in runs["shape detail"].output)


@pytest.mark.multiprocess
def test_py_spy_shows_every_rank_waiting_in_recv():
    marker = uuid.uuid4().hex
    done: list = []
    thread = threading.Thread(target=lambda: done.extend(run_agents(
        [agent("deadlock", "deadlock.py", env={"DDPGUIDE_DEMO_JOB": marker})],
        timeout=120, raise_on_timeout=False, failure_grace_s=120)))
    thread.start()
    stacks: dict[int, tuple[bool, str]] = {}
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline and len(stacks) < 2:
            for rank, pid in find_workers("DDPGUIDE_DEMO_JOB", marker).items():
                attached, text = dump_stack(pid)
                if not attached or "exchange (" in text:
                    stacks[rank] = (attached, text)
            time.sleep(0.5)
    finally:
        for pid in find_workers("DDPGUIDE_DEMO_JOB", marker).values():
            os.kill(pid, signal.SIGKILL)
        thread.join(150)
    assert not thread.is_alive()
    assert sorted(stacks) == [0, 1], stacks
    if not all(attached for attached, _ in stacks.values()):
        pytest.skip(f"py-spy cannot attach here: {next(t for a, t in stacks.values() if not a)}")
    recv_line = line_number("deadlock.py", "dist.recv(received")
    for _, text in stacks.values():
        assert "recv (torch/distributed/distributed_c10d.py:" in text
        assert f"exchange (deadlock.py:{recv_line})" in text
        assert "main (deadlock.py:" in text


@pytest.mark.multiprocess
def test_debug_server_shows_every_rank_waiting_in_recv_and_their_flight_records():
    import json

    from ddpguide.core.processes import ephemeral_port
    from ddpguide.doctor.stacks import debug_server_page, marked_processes

    port, marker = ephemeral_port(), uuid.uuid4().hex
    done: list = []
    thread = threading.Thread(target=lambda: done.extend(run_agents(
        [agent("server", "debug_server.py", env={"DEBUG_SERVER_PORT": str(port),
                                                 "DDPGUIDE_DEMO_JOB": marker})],
        timeout=120, raise_on_timeout=False, failure_grace_s=120)))
    thread.start()
    stacks = records = None
    try:
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            stacks = debug_server_page(f"http://127.0.0.1:{port}/stacks")
            if stacks and len(stacks) == 2 and all(" in recv" in text for _, text in stacks):
                records = debug_server_page(f"http://127.0.0.1:{port}/fr_trace_json")
                break
            time.sleep(0.5)
    finally:
        for pid in find_workers("DDPGUIDE_DEMO_JOB", marker).values():
            os.kill(pid, signal.SIGKILL)
        thread.join(150)
        for pid in marked_processes("DDPGUIDE_DEMO_JOB", marker):
            os.kill(pid, signal.SIGKILL)
    assert not thread.is_alive()
    recv_at = f'debug_server.py", line {line_number("debug_server.py", "dist.recv(")} in main'
    assert stacks and [head.split(":")[0] for head, _ in stacks] == ["Rank 0", "Rank 1"]
    assert all(recv_at in text for _, text in stacks), stacks
    parsed = [json.loads(text) for _, text in records]
    assert [[(e["profiling_name"], e["input_sizes"]) for e in r["entries"]] for r in parsed] == \
        [[("gloo:all_reduce", [[4]])]] * 2
