"""Every tensor a program gives a collective lives on the rank's device: checked on the CPU by
``ddpguide.core.collective_devices``, which follows where each tensor of the program's own code
was made and stops the program at a collective given one made on the host (on nccl it would be
on the CPU: "No backend type associated with device type cpu")."""

from __future__ import annotations

import subprocess

import pytest

from ddpguide.core.collective_devices import EXIT_STATUS
from ddpguide.launch.programs import run
from tests.programs import programs_support

CHECKED = ("torchrun", "--standalone", "--nproc-per-node=2", "-m", "ddpguide.core.collective_devices")
PROGRAM = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
device = torch.device("cpu")
placed = torch.zeros(2, device=device)
moved = torch.ones(2).to(device)
dist.all_reduce(placed + moved)
dist.all_reduce(torch.stack([placed, moved]).sum(0))
{last}
dist.destroy_process_group()
"""


#: ``python -m ddpguide.core.collective_devices program.py`` as a script, so that the suite's
#: runner can fork it warm (the first run is typed; the module itself runs under torchrun below)
CHECKER = """\
import runpy, sys
sys.argv = [sys.argv[0], "program.py"]
runpy.run_module("ddpguide.core.collective_devices", run_name="__main__", alter_sys=True)
"""


def check(tmp_path, last: str) -> subprocess.CompletedProcess:
    (tmp_path / "program.py").write_text(PROGRAM.format(last=last))
    (tmp_path / "checker.py").write_text(CHECKER)
    return programs_support.run([programs_support.PYTHON, "checker.py"], tmp_path, timeout=120)


@pytest.mark.parametrize("last", [
    "dist.all_reduce(torch.tensor([1.0]))",
    "dist.all_gather([torch.zeros(2, device=device)], torch.arange(2.0) * 2)",
    "dist.broadcast(torch.zeros(2, device=device).cpu(), 0)",
])
def test_a_tensor_made_on_the_host_is_refused_at_its_collective(tmp_path, last):
    done = check(tmp_path, last)
    assert done.returncode == EXIT_STATUS, done.stderr
    assert done.stderr.startswith("collective device check: torch.distributed.")
    assert "made on the host at program.py:10 " in done.stderr


def test_tensors_on_the_device_pass(tmp_path):
    done = check(tmp_path, "dist.all_reduce(torch.tensor([1.0], device=device))")
    assert done.returncode == 0, done.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_ring_attention_gives_its_collectives_device_tensors(tmp_path):
    done = run("ring_attention.py", launcher=CHECKED, timeout=300, echo=False, expect=None,
               workdir=tmp_path)
    assert "collective device check" not in done.output, done.output
    assert done.returncode == 0
    assert "all checks passed" in done.output
