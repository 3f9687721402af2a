"""The cluster programs talk to the package through ``--report`` (``launch.report``): a
missing folder is refused in one line before any process group, and a report that is not
one ends the run in one line (no cluster needed: the launch is planted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpguide.cluster import experiments
from ddpguide.launch.programs import path_of
from ddpguide.launch.ranks import RankEnd

PROGRAMS = ["cluster/collectives.py", "cluster/sharding.py", "cluster/ddp_overlap.py",
            "cluster/dead_link.py"]


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_report_into_a_missing_folder_is_refused_in_one_line(name, tmp_path):
    target = tmp_path / "nowhere" / "report.json"
    done = subprocess.run([sys.executable, str(path_of(name)), "--report", str(target)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    program = Path(name).name
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"{program}: error: argument --report: no folder {target.parent}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--round-trips"])
def test_collectives_refuses_no_round_trips_or_repeats_in_one_line(option, tmp_path):
    done = subprocess.run([sys.executable, str(path_of("cluster/collectives.py")), option, "0",
                           "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "collectives.py: error: --round-trips and --repeats must be at least 1\n"
    assert list(tmp_path.iterdir()) == []


def planted(text: str | None, returncode: int = 0):
    """A launch on every node that writes ``text`` as the report (None: none) and ends."""
    def torchrun_on(cluster, program, timeout, **kwargs):
        if text is not None:
            Path(program[program.index("--report") + 1]).write_text(text)
        return [RankEnd("node0", returncode, "out", "err tail")]
    return torchrun_on


@pytest.mark.parametrize(("text", "returncode", "message"), [
    ('{"checks": [], "world": 4}', 0, None),
    ('{"world": 4}', 0, "collectives.py on the cluster: the report .* has no list of checks"),
    (None, 0, "collectives.py on the cluster wrote no report at "),
    ('{"checks": []}', 1, "collectives.py on the cluster: node0: exit 1: err tail"),
])
def test_the_report_is_read_through_launch_report(monkeypatch, text, returncode, message):
    monkeypatch.setattr(experiments, "torchrun_on", planted(text, returncode))
    if message is None:
        assert experiments.collectives(None) == {"checks": [], "world": 4}  # type: ignore[arg-type]
    else:
        with pytest.raises(experiments.ProgramFailed, match=message):
            experiments.collectives(None)  # type: ignore[arg-type]
