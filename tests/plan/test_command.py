"""The command the planner prints, run as printed: each line on its node, NODE0 as node 0's
address, only the measurement's options added; lines that do not fit the cluster refused in
one line; the comparison with the prediction fails on a prediction off by 2; and (root) the
printed lines run on a 2-node emulated cluster within the bands."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpguide.cluster import netns
from ddpguide.core.commands import InputError
from ddpguide.plan import catalog, checks, command, measure, render, search

SHAPE, SEQ, BATCH = dict(checks.TIME_MODEL), checks.TIME_SEQ, checks.TIME_BATCH
CLUSTER = SimpleNamespace(nodes=[SimpleNamespace(name=f"node{k}", address=f"10.9.0.{k + 1}") for k in range(2)],
                          spec=SimpleNamespace(ranks_per_node=2))


@pytest.fixture(scope="module")
def p():
    return search.program()


def _lines(p, **layout):
    return render.command(p.Layout(**layout), 2, catalog.model(p, "gpt", **SHAPE), SEQ, BATCH, "float32")


def test_each_line_runs_on_its_node_as_printed(p):
    lines = _lines(p, pp=2, dp_shard=2, microbatches=4)
    work = command.on_nodes(CLUSTER, lines, Path("/r/report.json"), steps=5)
    assert [node.name for node, _ in work] == ["node0", "node1"]
    for (_, argv), line in zip(work, lines):
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert argv[3:-5] == shlex.split(line.replace("NODE0:", "10.9.0.1:"))[1:]  # the rest as printed
        assert argv[-5:] == ["--steps", "5", "--cost", "--report", "/r/report.json"]
        assert "--rdzv-endpoint" in argv and argv[argv.index("--rdzv-endpoint") + 1] == "10.9.0.1:29500"


@pytest.mark.parametrize("change, message", [
    (lambda lines: lines[:1], "1 torchrun lines for a cluster of 2 nodes"),
    (lambda lines: lines[::-1], "line 1 is not torchrun --node-rank 0 --nproc-per-node 2: "),
    (lambda lines: [x.replace("--nproc-per-node 2", "--nproc-per-node 4") for x in lines],
     "line 1 is not torchrun --node-rank 0 --nproc-per-node 2: "),
    (lambda lines: [x + " --text NODE0" for x in lines], "line 1 names NODE0 other than as the rendezvous host: "),
])
def test_lines_that_do_not_fit_the_cluster_are_refused_in_one_line(p, change, message):
    with pytest.raises(InputError) as refused:
        command.on_nodes(CLUSTER, change(_lines(p, dp_shard=4)), Path("r.json"), steps=5)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "6", "--gpus-per-node", "4", "--hardware", "this-machine"],
     "--gpus 6: does not fill whole nodes of 4 GPUs (--gpus-per-node 4); plan a multiple of 4"),
    (["--gpus", "12", "--hardware", "this-machine"],
     "--gpus 12: does not fill whole nodes of 8 GPUs (--gpus-per-node 8); plan a multiple of 8"),
])
def test_gpus_that_do_not_fill_nodes_are_refused_before_measuring(argv, message, capsys):
    from ddpguide.plan.__main__ import main

    assert main(argv) == 2
    assert capsys.readouterr().err == f"python -m ddpguide.plan: {message}\n"


def _cost_of(p, row, step_s: float) -> dict:
    """A run that measured exactly the predicted memory of each rank and a step of ``step_s``."""
    model, pol = catalog.model(p, "gpt", **SHAPE), catalog.policy(p, "float32")
    memory = [{k: v for k, v in p.memory(model, row["layout"], pol, BATCH, SEQ, r).items() if k in measure.MEMORY}
              for r in range(row["layout"].world)]
    return {"step_seconds": step_s, "memory": memory}


def _doubled(p):
    """The planner's memory formula off by 2: every part twice what it is."""
    return SimpleNamespace(**{**vars(p), "memory": lambda *a: {k: 2 * v for k, v in p.memory(*a).items()}})


def test_a_prediction_off_by_two_fails_the_comparison(p):
    model, pol = catalog.model(p, "gpt", **SHAPE), catalog.policy(p, "float32")
    hw = p.Hardware(gpus_per_node=2, nics=1, backend="gloo", links={"node": [1e-4, 1e-9, 0.0],
                                                                     "net": [5e-4, 4e-7, 65536.0]})
    row = search.rank(p, model, pol, hw, 4, BATCH, SEQ, True)[0]
    cost = _cost_of(p, row, row["step"]["total"])
    exact = command.compared(p, row, SHAPE, SEQ, BATCH, "float32", cost)
    assert exact["step"] == pytest.approx(1) and exact["memory"] == pytest.approx(1) and command.outside(exact) == []
    slow = {**row, "step": {**row["step"], "total": 2 * row["step"]["total"]}}
    off = command.compared(_doubled(p), slow, SHAPE, SEQ, BATCH, "float32", cost)
    assert command.outside(off) == ["step predicted / measured 2.000 outside 0.8-1.25",
                                    "memory predicted / measured 2.000 outside 0.9-1.1"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(netns.missing_prerequisite() is not None, reason=str(netns.missing_prerequisite()))
def test_the_printed_command_runs_on_the_cluster_as_predicted(p, tmp_path):
    """The planner on the cluster's hardware (measured first, microbenchmarks only), its lines run
    as printed on both nodes: step and memory predicted over measured within their bands, and
    the same run against a prediction off by 2 outside them; no namespace left."""
    from ddpguide.cluster import Spec, up

    with up(Spec(nodes=2, ranks_per_node=2, link=checks.LINK)) as cluster:
        hw = measure.cluster_hardware(p, cluster, tmp_path / "hw", seconds=0.02, repeats=3)
        row, lines = command.printed(p, command.write_hardware(hw, tmp_path / "cluster.json"), 4, 2, SHAPE, SEQ,
                                     BATCH, "float32")
        cost = command.run(cluster, lines, steps=8, timeout=300, folder=tmp_path / "run")
        run_id = cluster.run_id
    assert len(lines) == 2 and all(line.startswith("torchrun --nnodes 2 --node-rank") for line in lines)
    found = command.compared(p, row, SHAPE, SEQ, BATCH, "float32", cost)
    assert command.outside(found) == [], (row["name"], found)
    slow = {**row, "step": {**row["step"], "total": 2 * row["step"]["total"]}}
    assert len(command.outside(command.compared(_doubled(p), slow, SHAPE, SEQ, BATCH, "float32", cost))) == 2
    assert run_id not in netns.read_records()
