"""Each torchrun program puts its rank where the package's runtime would, with the CUDA device
count simulated: one GPU per local rank, the one GPU a launcher leaves each rank
(CUDA_VISIBLE_DEVICES), or the CPU where ranks would share a GPU. A torchrun worker other than
local rank 0 that sees one listed GPU shares it with rank 0 (torchrun passes the same
CUDA_VISIBLE_DEVICES to every worker): refused in one line, by the programs (exit 2) and the
runtime alike. The debug programs run on gloo on every machine (chapter 10 checks gloo's
behaviour)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpguide.core.runtime import select_runtime, shared_gpu_refusal
from tests.programs.programs_support import PROGRAMS, load_program

# plan_measure.py's --sweep runs under torchrun but measures gloo on this machine's CPUs on
# purpose (a GPU's figures come from its data sheet), so it has no rank device to choose.
CPU_MEASUREMENTS = {"plan_measure.py"}
TORCHRUN_PROGRAMS = sorted(  # every folder's: the GPT's train.py too
    str(path.relative_to(PROGRAMS)) for path in PROGRAMS.glob("**/*.py")
    if "LOCAL_WORLD_SIZE" in path.read_text() and path.parent.name != "debug"
    and path.name not in CPU_MEASUREMENTS)
DEBUG_PROGRAMS = sorted(path.name for path in (PROGRAMS / "debug").glob("*.py"))
REFUSED = "refused"
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job"}  # what torchrun's agent sets in every worker

CASES = [  # (GPUs this process sees, its environment, the device it must use)
    (1, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "3"}, "cuda:0"),
    (1, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "GPU-5c1e"}, "cuda:0"),
    (8, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, "cuda:3"),
    (1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "cpu"),  # one GPU, two ranks: no binding
    (2, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, "cpu"),
    (0, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "cpu"),
    # CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node=2: both workers are told "0"
    (1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0", **TORCHRUN},
     "cuda:0"),
    (1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0", **TORCHRUN},
     REFUSED),
    # torchrun --virtual-local-rank --nproc-per-node=8: each worker its own GPU, LOCAL_RANK 0
    (1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "5", **TORCHRUN},
     "cuda:0"),
]


def simulate(monkeypatch, gpus: int, environ: dict[str, str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for name in ("CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


def test_the_torchrun_programs_are_found():
    assert {"ddp_torchrun.py", "elastic_train.py", "fsdp2.py", "fsdp_tp_2d.py", "zero1.py",
            "dcp_reshard.py", "tensor_parallel.py", "dtensor_sbp.py", "gpt/train.py"} <= set(TORCHRUN_PROGRAMS)


@pytest.mark.parametrize("gpus, environ, expected", CASES)
@pytest.mark.parametrize("name", TORCHRUN_PROGRAMS)
def test_a_torchrun_program_uses_the_gpu_of_its_rank(monkeypatch, capsys, name, gpus, environ,
                                                      expected):
    monkeypatch.syspath_prepend(str((PROGRAMS / name).parent))  # its neighbours (gpt/model.py)
    program = load_program(PROGRAMS / name)
    simulate(monkeypatch, gpus, environ)
    if expected == REFUSED:
        with pytest.raises(SystemExit) as stopped:
            program.rank_device()
        assert stopped.value.code == 2
        assert capsys.readouterr().err == shared_gpu_refusal(gpus, int(environ["LOCAL_WORLD_SIZE"])) + "\n"
    else:
        assert str(program.rank_device()) == expected


@pytest.mark.parametrize("gpus, environ, expected", CASES)
def test_the_programs_and_the_runtime_agree(monkeypatch, gpus, environ, expected):
    simulate(monkeypatch, gpus, environ)
    import os

    if expected == REFUSED:
        with pytest.raises(ValueError) as refused:
            select_runtime(int(environ["LOCAL_WORLD_SIZE"]), environ=os.environ)
        assert str(refused.value) == shared_gpu_refusal(gpus, int(environ["LOCAL_WORLD_SIZE"]))
        return
    runtime = select_runtime(int(environ["LOCAL_WORLD_SIZE"]), environ=os.environ)
    assert str(runtime.device(int(environ["LOCAL_RANK"]))) == expected
    assert runtime.backend == ("nccl" if expected.startswith("cuda") else "gloo")


def test_spawned_workers_fall_back_to_gloo_where_gpus_are_too_few(monkeypatch):
    """The parent chooses for every worker it spawns (no LOCAL_RANK yet): gloo, as documented."""
    simulate(monkeypatch, 1, {})
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert select_runtime(2).backend == "gloo"


@pytest.mark.parametrize("name", DEBUG_PROGRAMS)
def test_a_debug_program_runs_on_gloo_and_the_cpu_even_with_gpus(monkeypatch, name):
    program = load_program(PROGRAMS / "debug" / name)
    simulate(monkeypatch, 8, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    calls = []
    timeouts = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "set_timeout", lambda timeout, group=None: timeouts.append(timeout))
    assert program.start() == torch.device("cpu")
    assert [args[0] if args else kwargs["backend"] for args, kwargs in calls] == ["gloo"]
    # joined with the long timeout (ranks that start slowly still join), then the short one set
    assert calls[0][1]["timeout"] == program.JOIN_TIMEOUT
    assert timeouts == [program.TIMEOUT] and program.TIMEOUT < program.JOIN_TIMEOUT
