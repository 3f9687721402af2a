"""Faults that need real nodes, on one cluster of 3 nodes x 1 rank, node 1 on a slow link:
the doctor across the nodes names node 1's link, and an elastic run that loses node 2 by
its link goes on without it."""

from __future__ import annotations

import pytest

from ddpguide.bench.cluster_elastic import lose_node_by_link
from ddpguide.cluster import Spec, netns, up
from ddpguide.cluster.experiments import doctor

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(netns.missing_prerequisite() is not None,
                                 reason=str(netns.missing_prerequisite()))]
SLOW_LINK = "50mbit"


@pytest.fixture(scope="module")
def cluster():
    with up(Spec(nodes=3, ranks_per_node=1, link="1gbit", slow_node=1, slow_link=SLOW_LINK)) as made:
        yield made


@pytest.mark.slow  # chapter 15 runs the same doctor live, and checks the same lines
@pytest.mark.timeout(400)
def test_the_doctor_across_the_nodes_names_the_slow_node_s_link(cluster):
    result = doctor(cluster, timeout=300)
    assert result["returncodes"] == [1, 1, 1], result["lines"][-10:]  # one problem: exit 1 everywhere
    report = result["report"]
    assert [(r["rank"], r["host"]) for r in report["ranks"]] == [(0, "node0"), (1, "node1"), (2, "node2")]
    [problem] = report["problems"]
    assert (problem["rank"], problem["host"]) == (1, "node1")
    assert problem["message"].startswith("slow link: host node1 moves at most ")
    hosts = report["links"]["hosts"]
    assert hosts["node1"] < 0.5 * min(hosts["node0"], hosts["node2"])
    assert f"PROBLEM rank 1 (host node1): {problem['message']}" in result["lines"]


@pytest.mark.timeout(400)
def test_an_elastic_run_loses_a_node_by_its_link_and_the_others_go_on(cluster):
    # the chapter's saved run has a 10 s timeout; the bounds below scale with it
    epochs, timeout = 8, 5.0
    result = lose_node_by_link(cluster, node=2, after_epoch=2, epochs=epochs, pg_timeout=timeout,
                               timeout=300)
    codes = result["returncodes"]
    assert codes[:2] == [0, 0] and codes[2] != 0, (codes, result["errors"])  # node 2: stopped or failed
    records = result["records"]
    assert [r["epoch"] for r in records] == list(range(epochs))  # every epoch once, in order
    before = [(r["world_size"], r["restart_count"]) for r in records if r["world_size"] == 3]
    after = [(r["world_size"], r["restart_count"]) for r in records if r["world_size"] != 3]
    assert before == [(3, 0)] * len(before) and len(before) >= 3
    assert after == [(2, 1)] * len(after) and len(before) + len(after) == epochs
    down = next(e["t"] for e in result["timeline"] if e["event"] == "link down")
    first_after = next(e["t"] for e in result["timeline"]
                       if e["event"] == "epoch" and e["world_size"] == 2)
    assert first_after - down >= result["pg_timeout"]  # nothing told them before the timeout
    # the first survivor to give up fails on gloo's timeout; the other on the same timeout, or,
    # when the first one's exit reaches it before its own timer fires, on that closed connection
    timed_out = [f"Timed out waiting {timeout * 1000:.0f}ms for" in line for line in result["errors"][:2]]
    assert any(timed_out), result["errors"]
    assert all(t or "Connection closed by peer" in line for t, line in zip(timed_out, result["errors"])), \
        result["errors"]
    with pytest.raises(ValueError, match="node 0 hosts the rendezvous store"):
        lose_node_by_link(cluster, node=0)
