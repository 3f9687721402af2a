"""The planner reads ``train.py``'s report through ``launch.report`` only: a report that
breaks the contract, one with a failed check or one without a cost ends the run in one
line (no cluster needed: the launch on the nodes is planted)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpguide.cluster import launch
from ddpguide.launch.ranks import RankEnd
from ddpguide.launch.report import ReportError
from ddpguide.plan import catalog, hardware, measure, search

COST = {"memory": [{"parameters": 1}], "step_seconds": 0.5}
CLUSTER = SimpleNamespace(spec=SimpleNamespace(link="10mbit", nodes=2))


def planted(text: str | None, returncode: int = 0):
    """A launch on every node that writes ``text`` as the report (None: none) and ends."""
    def torchrun_on(cluster, program, timeout, **kwargs):
        if text is not None:
            Path(program[program.index("--report") + 1]).write_text(text)
        return [RankEnd("node0", returncode, "out", "err tail"), RankEnd("node1", 0, "", "")]
    return torchrun_on


@pytest.mark.parametrize(("text", "returncode", "message"), [
    ('{"checks": [], "cost": {"memory": [{"parameters": 1}], "step_seconds": 0.5}}', 0, None),
    ('{"cost": {"step_seconds": 0.5}}', 0, r"on the cluster: the report \S+ has no list of checks$"),
    ('{"checks": [{"name": "loss", "ok": "yes"}], "cost": {}}', 0,
     r"on the cluster: the report \S+ check 0 is not an object with a name and ok"),
    ('[1, 2]', 0, r"on the cluster: the report \S+ holds a list, not an object$"),
    ('{"checks": [{"name": "loss", "ok": false}], "cost": {}}', 0, r"on the cluster: failed checks in \S+: loss$"),
    ('{"checks": []}', 0, r"on the cluster: the report \S+ holds no cost \(was --cost given\?\)$"),
    (None, 0, r"on the cluster wrote no report at \S+$"),
    ('{"checks": [], "cost": {}}', 1, r"on the cluster: node0: exit 1: err tail$"),
])
def test_the_report_of_train_py_is_read_through_launch_report(monkeypatch, text, returncode, message):
    monkeypatch.setattr(launch, "torchrun_on", planted(text, returncode))
    p = search.program()
    model, layout = catalog.model(p, "gpt-check"), p.Layout(dp_replicate=2)
    run = lambda: measure.run_on_cluster(CLUSTER, layout, model, 16, 8, "float32")  # noqa: E731
    if message is None:
        assert run() == COST
    else:
        with pytest.raises(ReportError, match=message) as refused:
            run()
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith("gpt/train.py --dp-replicate 2")


def test_a_cached_cluster_run_is_read_back_only_with_the_table_it_was_measured_beside(monkeypatch, tmp_path):
    """The cluster's table is part of a kept run's key: the same table reads the run back, a
    table measured at another time (another fingerprint) runs it again."""
    launches = []

    def counting(cluster, program, timeout, **kwargs):
        launches.append(program)
        return planted(json.dumps({"checks": [], "cost": {**COST, "step_seconds": len(launches)}}))(
            cluster, program, timeout, **kwargs)
    monkeypatch.setattr(launch, "torchrun_on", counting)
    p = search.program()
    model, layout = catalog.model(p, "gpt-check"), p.Layout(dp_replicate=2)
    run = lambda beside: measure.run_on_cluster(CLUSTER, layout, model, 16, 8, "float32",  # noqa: E731
                                                cache=str(tmp_path), beside=beside)
    first = measure.fingerprint(p.Hardware(peak=1e9))
    assert first == measure.fingerprint(p.Hardware(peak=1e9)) != measure.fingerprint(p.Hardware(peak=2e9))
    assert run(first)["step_seconds"] == 1 and run(first)["step_seconds"] == 1 and len(launches) == 1
    assert run(measure.fingerprint(p.Hardware(peak=2e9)))["step_seconds"] == 2 and len(launches) == 2


def _planted_machine(monkeypatch, p):
    """This machine's hardware, each measurement twice as fast as the one before (a machine
    whose load changes between tables), and train.py's runs planted: a step of 0.1 s, the
    matmul rate of 1e9 FLOP/s in its ranks."""
    tables = []

    def measured(p_, ranks=4, folder=None):
        tables.append(ranks)
        return p.Hardware(name="this-machine", peak=1e9 * 2 ** len(tables), bandwidth=1e10, cores=2.0,
                          gpus_per_node=8, links={"node": [1e-4, 1e-9, 0.0], "net": [1e-4, 1e-9, 0.0]})
    runs = []

    def cost(options, ranks, **kwargs):
        runs.append(options)
        return {"step_seconds": 0.1, "peak_flops": 1e9, "alone_flops": 1e9, "shared_flops": 1e9 * ranks / 2,
                "shared_windows": [], "memory": [{"parameters": 1}] * ranks}, None
    monkeypatch.setattr(hardware, "measured", measured)
    monkeypatch.setattr(measure.gpt_cost, "measure", cost)
    return tables, runs


def test_a_cached_loopback_run_comes_back_with_the_table_measured_beside_it(monkeypatch, tmp_path):
    """Each loopback run is predicted from the table measured just before it, with as many
    ranks; a benchmark reading the runs back from the cache predicts them from the tables kept
    with them (the same ratios), not from a table measured now (a faster one, planted)."""
    from ddpguide.bench import plan_loopback
    from ddpguide.bench.report import Report

    p = search.program()
    tables, runs = _planted_machine(monkeypatch, p)
    bar = SimpleNamespace(total=0, update=lambda: None)
    first, again = Report("plan"), Report("plan")
    plan_loopback.loopback_check(first, p, str(tmp_path), bar)
    assert tables == [ranks for _, ranks, *_ in plan_loopback.LOOPBACK] and len(runs) == len(plan_loopback.LOOPBACK)
    table_ms = [m.details["table_predicted_ms"] for m in first.measurements]
    assert len(set(table_ms)) == len(table_ms)  # each from its own table
    plan_loopback.loopback_check(again, p, str(tmp_path), bar)
    assert len(tables) == len(runs) == len(plan_loopback.LOOPBACK)  # nothing measured again
    assert again.ratios == first.ratios
    fresh = Report("plan")
    plan_loopback.loopback_check(fresh, p, None, bar)  # no cache: new tables, twice as fast, beside new runs
    assert all(fresh.ratios[k] != first.ratios[k] for k in first.ratios if "table" in k)
