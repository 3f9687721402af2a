"""The planner reads ``train.py``'s report through ``launch.report`` only: a report that
breaks the contract, one with a failed check or one without a cost ends the run in one
line (no cluster needed: the launch on the nodes is planted)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpguide.cluster import launch
from ddpguide.launch.ranks import RankEnd
from ddpguide.launch.report import ReportError
from ddpguide.plan import catalog, measure, search

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
