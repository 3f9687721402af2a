"""torchrun for real: standalone training, two nodes on 127.0.0.1, the error file, the recipes.

Every launch goes through :func:`ddpguide.launch.torchrun.run_agents`, which is
bounded in time; each test also checks that no process of its launches is
still alive afterwards (workers run in sessions of their own, so the
children-of-pytest check of conftest.py alone would not see an orphan).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import stat
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from ddpguide.core.runtime import select_runtime
from ddpguide.launch import torchrun as agents
from ddpguide.train import torchrun_demo as tr

REPO = Path(__file__).resolve().parents[2]


def _assert_nothing_left(*launch_ids: str) -> None:
    for launch_id in launch_ids:
        assert agents.processes_of_launch(launch_id) == [], f"launch {launch_id} left processes"


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_standalone_two_workers_train_and_the_loss_falls(tmp_path):
    summary_path = tmp_path / "run.json"
    run = agents.run_torchrun(
        ["--standalone", "--nproc-per-node=2"], "ddpguide.train",
        ["--epochs", "1", "--max-steps-per-epoch", "20", "--lr", "0.01", "--dataset", "digits",
         "--no-eval", "--json", str(summary_path)],
        timeout=120,
    )
    _assert_nothing_left(run.launch_id)
    assert run.ok, "\n".join(run.lines()[-30:])
    summary = json.loads(summary_path.read_text())
    assert summary["result"]["world_size"] == 2 and summary["result"]["rank"] == 0
    losses = summary["step_losses"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    # torchrun chose OMP_NUM_THREADS=1 for its two workers, and said so
    expected = select_runtime(2)  # the workers inherit this process's DDPGUIDE_* choices
    assert (f"[rank 0] world size 2 (2 per node), backend {expected.backend} on "
            f"{expected.device_type}, OMP_NUM_THREADS=1") in run.output
    assert "Setting OMP_NUM_THREADS environment variable for each process to be 1" in run.output


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_static_two_nodes_reproduce_the_seed_table():
    nodes = tr.two_nodes_static(nproc_per_node=2, timeout=120)
    _assert_nothing_left(*(r.launch_id for r in nodes.runs))
    assert nodes.ok, [r.lines()[-20:] for r in nodes.runs]
    rows = [(r["node_name"], int(r["GROUP_RANK"]), int(r["LOCAL_RANK"]), int(r["RANK"]))
            for r in nodes.records]
    # the source's table 5-1: machine 0 holds ranks 0, 1 and machine 1 ranks 2, 3; local ranks 0, 1 on each
    assert rows == [("node-A", 0, 0, 0), ("node-A", 0, 1, 1),
                    ("node-B", 1, 0, 2), ("node-B", 1, 1, 3)]
    for r in nodes.records:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
        assert r["group_rank_of_process"] == int(r["RANK"]) and r["group_size"] == 4
        assert r["all_reduce_of_ones"] == 4  # all four workers are in one process group
        assert r["OMP_NUM_THREADS"] == "1" and r["torch_threads"] == 1
        assert r["MASTER_ADDR"] == "127.0.0.1"
    # each node's workers are children of that node's agent
    agent_pids = defaultdict(set)
    for r in nodes.records:
        agent_pids[r["node_name"]].add(r["parent_pid"])
    assert all(len(pids) == 1 for pids in agent_pids.values())
    assert agent_pids["node-A"] != agent_pids["node-B"]


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_c10d_rendezvous_assigns_a_valid_layout():
    nodes = tr.two_nodes_c10d(nproc_per_node=2, timeout=120)
    _assert_nothing_left(*(r.launch_id for r in nodes.runs))
    assert nodes.ok, [r.lines()[-20:] for r in nodes.runs]
    records = nodes.records
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3]
    by_node = defaultdict(list)
    for r in records:
        by_node[r["node_name"]].append(r)
    assert sorted(by_node) == ["node-A", "node-B"]
    group_of = {}
    for name, workers in by_node.items():
        assert sorted(int(w["LOCAL_RANK"]) for w in workers) == [0, 1]
        assert len({w["GROUP_RANK"] for w in workers}) == 1
        group = int(workers[0]["GROUP_RANK"])
        group_of[name] = group
        ranks = sorted(int(w["RANK"]) for w in workers)
        # contiguous ranks: a node's workers are numbered one after the other
        assert ranks == [2 * group, 2 * group + 1]
        for w in workers:
            assert int(w["RANK"]) == 2 * group + int(w["LOCAL_RANK"])
    assert sorted(group_of.values()) == [0, 1]
    for r in records:
        assert r["WORLD_SIZE"] == "4" and r["all_reduce_of_ones"] == 4
    # the rendezvous sorts the nodes by (host, agent pid): on one host the lower pid is node 0
    agent_pid = {name: workers[0]["parent_pid"] for name, workers in by_node.items()}
    first = min(agent_pid, key=agent_pid.get)
    assert group_of[first] == 0


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_a_crashing_worker_is_reported_through_its_error_file():
    crash = tr.crash_demo(nproc_per_node=2, crash_rank=1, timeout=120)
    _assert_nothing_left(crash.run.launch_id)
    assert crash.run.returncode not in (0, None)
    # the reader's program, whose main() is wrapped in @record, wrote rank 1's error file
    message = "DeliberateCrash: rank 1 crashed on purpose before training (--crash-rank)"
    assert crash.errors[1].exception == message
    assert Path(crash.errors[1].file).name == "ddp_torchrun.py"
    assert crash.errors[1].function == "worker"
    # torchrun's failure summary carries the traceback text from the error file
    assert message in crash.run.output
    assert "ddp_torchrun.py FAILED" in crash.run.output
    reported = tr.failure_summary(crash.run.output)
    assert sorted(e["rank"].split()[0] for e in reported) == ["0", "1"]
    assert [e["section"] for e in reported].count("root cause") == 1
    assert next(e for e in reported if e["rank"].startswith("1"))["exitcode"].startswith("1 ")
    # the agent's own error file holds the failure with the earliest timestamp
    root = crash.root_cause
    assert root is not None
    assert root.timestamp == min(e.timestamp for e in crash.errors.values())
    assert root in crash.errors.values()


@pytest.mark.timeout(90)
@pytest.mark.multiprocess
def test_a_hanging_launch_is_stopped_with_all_its_workers(tmp_path):
    # two workers that say they started, then hang; the agent never finishes by itself
    agent = agents.Agent("hang", ("--standalone", "--nproc-per-node=2"), "sh",
                     ("-c", f'touch "{tmp_path}/started.$LOCAL_RANK"; exec sleep 600'),
                     no_python=True)
    with pytest.raises(agents.TorchrunTimeout, match=r"did not finish within 12 s") as info:
        agents.run_agents([agent], timeout=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started.0", "started.1"]
    _assert_nothing_left(info.value.launch_id)


@pytest.mark.timeout(90)
@pytest.mark.multiprocess
def test_a_taken_master_port_is_reported_as_eaddrinuse():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = agents.run_torchrun(
            ["--nnodes=1", "--node-rank=0", "--nproc-per-node=1", "--master-addr=127.0.0.1",
             f"--master-port={port}"], "ddpguide.launch.whoami", ["--no-group"], timeout=60)
    _assert_nothing_left(run.launch_id)
    assert run.returncode not in (0, None)
    assert tr._port_taken([run])  # the text the retry looks for is what torchrun prints


def _fake_launches(monkeypatch, outputs):
    """Replace the real launch by one that returns the given outputs, one per call."""
    calls = []

    def fake_run_agents(agent_list, timeout):
        calls.append([a.torchrun_args for a in agent_list])
        text = outputs[len(calls) - 1]
        return [agents.AgentRun(a, 0 if not text else 1, text, 0.0, "id") for a in agent_list]

    ports = iter(range(50001, 50100))
    monkeypatch.setattr(tr, "run_agents", fake_run_agents)
    monkeypatch.setattr(tr, "ephemeral_port", lambda: next(ports))
    return calls


def test_the_launch_is_repeated_on_a_new_port_only_when_the_port_was_taken(monkeypatch):
    taken = "DistNetworkError: ... name: EADDRINUSE, message: address already in use"
    calls = _fake_launches(monkeypatch, [taken, ""])
    nodes = tr.two_nodes_static(attempts=3)
    assert nodes.attempts == 2 and nodes.ok
    # a fresh port for the second launch, and the same port for both agents of a launch
    assert [[a for a in agent if a.startswith("--master-port=")] for call in calls for agent in call] \
        == [["--master-port=50001"]] * 2 + [["--master-port=50002"]] * 2
    calls = _fake_launches(monkeypatch, [taken] * 3)
    with pytest.raises(tr.PortInUse, match="taken 3 times in a row"):
        tr.two_nodes_c10d(attempts=3)
    assert len(calls) == 3
    calls = _fake_launches(monkeypatch, ["RuntimeError: something else"])
    nodes = tr.two_nodes_static(attempts=3)
    assert len(calls) == 1 and nodes.attempts == 1 and not nodes.ok  # other failures: no retry


def test_simulated_nodes_never_share_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [tr.node_devices(n, 2) for n in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                      {"CUDA_VISIBLE_DEVICES": "6,7"}]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tr.node_devices(1, 2) == {"DDPGUIDE_BACKEND": "gloo", "DDPGUIDE_DEVICE": "cpu"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tr.node_devices(0, 2) == {}


def test_rank_table_shows_one_row_per_record():
    records = [{"node_name": "n", "RANK": str(i), "LOCAL_RANK": str(i), "GROUP_RANK": "0",
                "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"} for i in range(2)]
    lines = tr.rank_table(records).splitlines()
    assert lines[0].split() == list(tr.RANK_TABLE_COLUMNS)
    assert [line.split() for line in lines[2:]] == [["n", "0", "0", "0", "2", "2", "1"],
                                                    ["n", "0", "1", "1", "2", "2", "1"]]


# --- the cluster recipes ------------------------------------------------------------------

PROGRAM = REPO / "book" / "programs" / "ddp_torchrun.py"  # chapter 3's program


def _split_torchrun(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """torchrun's own options, the program it runs, and the program's arguments."""
    assert argv[0] == "torchrun"
    at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    return argv[1:at], argv[at], argv[at + 1:]


def _program_args(train_args: list[str], folder: Path, monkeypatch) -> argparse.Namespace:
    """The program's own parser on ``train_args``, as a worker under torchrun would parse them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_torchrun_recipe", PROGRAM)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    for name in program.LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "0" if "RANK" in name else "1")
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", ["ddp_torchrun.py", *train_args])
    return program.parse_args()


def _fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """``scontrol`` and ``srun`` stand-ins: the script runs, srun records its command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun_argv.json"
    scripts = {
        "scontrol": '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-07\\ngpu-08\\n"\n',
        "srun": f'#!{sys.executable}\nimport json, sys\n'
                f'json.dump(sys.argv[1:], open({str(record)!r}, "w"))\n',
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[07-08]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "32",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "ddp_torchrun", "HOME": str(tmp_path)}
    return env, record


def test_slurm_script_parses():
    done = subprocess.run(["bash", "-n", str(REPO / "cluster" / "slurm_torchrun.sbatch")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_slurm_script_starts_one_torchrun_per_node_with_a_valid_command(tmp_path, monkeypatch):
    env, record = _fake_slurm(tmp_path)
    env["PROGRAM"] = str(PROGRAM)
    done = subprocess.run(["bash", str(REPO / "cluster" / "slurm_torchrun.sbatch"), "--epochs", "5"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    srun_argv = json.loads(record.read_text())
    assert "--ntasks-per-node=1" in srun_argv
    torchrun_opts, program, train_args = _split_torchrun(srun_argv[srun_argv.index("torchrun"):])
    assert program == str(PROGRAM)  # the chapter's program, not the package's command
    opts = get_args_parser().parse_args([*torchrun_opts, program])
    assert (opts.nnodes, opts.nproc_per_node) == ("2", "4")
    assert (opts.rdzv_backend, opts.rdzv_endpoint, opts.rdzv_id) == ("c10d", "gpu-07:29500", "4242")
    args = _program_args(train_args, tmp_path, monkeypatch)
    assert args.epochs == 5  # arguments after the script name reach the program
    assert args.checkpoint == "checkpoints/ddp_torchrun.pt"
    assert "nodes=2 nproc_per_node=4 rendezvous=gpu-07:29500" in done.stdout


def test_slurm_script_without_the_program_says_so_and_starts_nothing(tmp_path):
    env, record = _fake_slurm(tmp_path)
    done = subprocess.run(["bash", str(REPO / "cluster" / "slurm_torchrun.sbatch")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr == ("no program at book/programs/ddp_torchrun.py "
                           "(set PROGRAM=path/to/ddp_torchrun.py)\n")
    assert not record.exists() and not (tmp_path / "checkpoints").exists()


def _k8s_commands() -> tuple[dict[str, list[str]], dict]:
    job = yaml.safe_load((REPO / "cluster" / "k8s_pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    return {role: spec["template"]["spec"]["containers"][0]["command"]
            for role, spec in job["spec"]["pytorchReplicaSpecs"].items()}, job


def test_k8s_job_runs_the_same_valid_command_in_every_pod(tmp_path, monkeypatch):
    commands, job = _k8s_commands()
    assert sorted(commands) == ["Master", "Worker"]
    assert commands["Master"] == commands["Worker"]
    torchrun_opts, program, train_args = _split_torchrun(commands["Master"])
    assert program == "/workspace/ddp_torchrun.py"  # the chapter's program, copied into the image
    # Kubernetes expands $(VAR) from the pod's environment; stand in for it here
    expanded = [a.replace("$(MASTER_ADDR)", "ddpguide-master-0").replace("$(MASTER_PORT)", "23456")
                for a in torchrun_opts]
    opts = get_args_parser().parse_args([*expanded, program])
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    assert opts.nnodes == str(pods)
    assert opts.nproc_per_node == job["spec"]["nprocPerNode"]
    for spec in specs.values():
        gpus = spec["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == opts.nproc_per_node
    assert (opts.rdzv_backend, opts.rdzv_endpoint) == ("c10d", "ddpguide-master-0:23456")
    # the program's own parser accepts the arguments (the volume stood in for by tmp_path)
    args = _program_args([a.replace("/checkpoints/", f"{tmp_path}/") for a in train_args],
                         tmp_path, monkeypatch)
    assert args.epochs == 3 and args.checkpoint == f"{tmp_path}/ddp_torchrun.pt"
    assert shlex.join(commands["Master"]).startswith("torchrun --nnodes=2")



def _peer_that_exits(rank: int, port: int, queue, peer_gone) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        os._exit(0)  # gone without a word, as a crashed worker
    peer_gone.wait(60)  # rank 1's process has ended: its sockets are closed
    try:
        dist.all_reduce(torch.ones(1))
        queue.put("no error")
    except RuntimeError as error:
        queue.put(f"{type(error).__name__}: {str(error).splitlines()[0]}")


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_gloo_names_a_dead_peer_and_the_error_summary_keeps_the_words():
    """Chapter 3 quotes gloo's words for rank 0 when rank 1 has died: they are gloo's, and shown."""
    import multiprocessing

    from ddpguide.core.processes import store_port

    context = multiprocessing.get_context("spawn")
    queue, peer_gone, port = context.Queue(), context.Event(), store_port()
    workers = [context.Process(target=_peer_that_exits, args=(rank, port, queue, peer_gone))
               for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        workers[1].join(90)
        peer_gone.set()
        message = queue.get(timeout=90)
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    assert message.startswith("RuntimeError: [") and "Connection closed by peer" in message, message
    shown = str(tr.ErrorSummary(message, "/x/utils.py", 299, "_verify_param_shape_across_processes", 0))
    assert "Connection closed by peer" in shown and "GLHF" not in shown, shown  # the first sentence


def test_the_agent_s_command_is_built_once_with_its_log_folder_among_torchrun_s_options():
    script = agents.Agent("a", ("--standalone", "--nproc-per-node=2"), "train.py", ("--epochs", "1"))
    module = agents.Agent("b", ("--standalone",), "ddpguide.train", ("--x",))
    own = agents.Agent("c", ("--log-dir", "mine"), "train.py")
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    assert script.argv(log_dir="logs") == [*launcher, "--log-dir", "logs", "--standalone",
                                           "--nproc-per-node=2", "train.py", "--epochs", "1"]
    assert module.argv() == [*launcher, "--standalone", "-m", "ddpguide.train", "--x"]
    parsed = get_args_parser().parse_args(script.argv(log_dir="logs")[3:])
    assert (parsed.log_dir, parsed.training_script, parsed.training_script_args) == (
        "logs", "train.py", ["--epochs", "1"])
    assert get_args_parser().parse_args(own.argv(log_dir="logs")[3:]).log_dir == "mine"  # its own wins
