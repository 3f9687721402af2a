"""The engine's placement on chapter 15's cluster: every address a node's, the lighthouse
found listening from outside its namespace, and a cut link survived with every invariant."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddpguide.cluster import netns
from ddpguide.cluster.spec import Node
from ddpguide.failures import chaos, engine, runs

NODE = Node(1, "ddpg-x-n1", "ddpg-x-1", "198.18.0.2", 10**9)
needs_root = pytest.mark.skipif(netns.missing_prerequisite() is not None,
                                reason=str(netns.missing_prerequisite()))


def test_a_group_on_a_node_meets_at_the_node_address_and_talks_over_its_interface(tmp_path):
    argv = engine.group_argv(engine.Settings(), 1, 29000, tmp_path, NODE)
    assert "--rdzv-endpoint=198.18.0.2:29000" in argv and "--standalone" not in argv
    assert not any("127.0.0.1" in a or "localhost" in a for a in argv)
    assert engine.group_env(1, 2, "http://198.18.0.1:1", NODE)["GLOO_SOCKET_IFNAME"] == "ddpg-x-1"
    here = engine.group_argv(engine.Settings(), 1, 29000, tmp_path)   # one machine, as before
    assert "--standalone" in here and engine.group_env(1, 2, "u")["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_link_is_cut_only_on_a_cluster():
    job = SimpleNamespace(settings=engine.Settings(groups=2), cluster=None)
    assert "link" not in chaos.Chaos(job, 0).kinds    # type: ignore[arg-type]
    assert "link" in chaos.Chaos(SimpleNamespace(settings=job.settings, cluster=object()),
                                 0).kinds            # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_root
def test_a_cut_link_on_the_cluster_is_survived_with_every_invariant(tmp_path):
    """2 nodes, a group each, the lighthouse on node 0; node 1's link down past the timeouts,
    then up: group 0 goes on alone within the stall bound, group 1 heals from it."""
    from ddpguide.bench.failures import stall_predicted_s
    from ddpguide.cluster.cluster import up
    from ddpguide.cluster.spec import Spec

    with up(Spec(nodes=2, ranks_per_node=1)) as cluster:
        report = runs.run_ft(tmp_path / "run", failures=1, seed=1, kinds=("link",), groups=2,
                             steps=400, step_seconds=0.1, gap_s=(0.5, 1.0), deadline_s=150.0,
                             cluster=cluster.run_id)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    assert [(f["what"], f["groups"]) for f in report["failures"]] == [
        ("link down", [1]), ("link up", [1])]
    assert all("198.18.0." in c for c in report["commands"][1:]), report["commands"]
    cut = report["failures"][0]
    assert any(h["group"] == 1 and h["time"] > cut["time"] for h in report["healed"])
    stall = runs.lost_s(report, cut)
    predicted = stall_predicted_s(report, cut, engine.Settings(step_seconds=0.1))
    assert stall is not None and 0.5 < stall / predicted < 2.0, (stall, predicted)


def test_the_after_hook_goes_into_every_entry_of_the_last_failure_once():
    job = SimpleNamespace(settings=engine.Settings(groups=2), cluster=None)
    calls = []
    trouble = chaos.Chaos(job, 0, after=lambda kind: calls.append(kind) or {"p": 1.0})  # type: ignore[arg-type]
    trouble.log = [{"what": "SIGKILL (kill)"}]
    trouble._pending = (1, "hang")
    trouble.log += [{"what": "SIGSTOP"}, {"what": "SIGKILL", "after": "SIGSTOP"}]
    trouble._after_last()
    trouble._after_last()                                   # nothing pending: not called again
    assert calls == ["hang"]
    assert [e.get("p") for e in trouble.log] == [None, 1.0, 1.0]


#: the first entry each kind of failure logs (``chaos.Chaos.inject``)
FIRST_ENTRY = {"kill": "SIGKILL (kill)", "segv": "SIGSEGV (segv)", "hang": "SIGSTOP",
               "lighthouse": "lighthouse killed", "heal": "SIGKILL (heal)",
               "quorum": "SIGKILL (quorum)", "two": "SIGKILL (two)", "term": "SIGTERM (term)",
               "link": "link down"}


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_root
def test_a_long_chaos_run_of_every_kind_on_the_cluster(tmp_path):
    """3 nodes, a group each, the lighthouse on node 0: every kind of failure once, in turn
    (a kill, a segfault, a hang, the lighthouse, a kill while healing, one while a quorum
    forms, two groups at once, a SIGTERM, a cut link), every invariant holding after them.
    torchrun may restart a group 16 times; the run ends 10 steps after the last failure's
    group is back (at most 2500 steps), within pytest's 300 s."""
    from ddpguide.cluster.cluster import up
    from ddpguide.cluster.spec import Spec

    assert set(FIRST_ENTRY) == set(chaos.KINDS)
    with up(Spec(nodes=3, ranks_per_node=1)) as cluster:
        report = runs.run_ft(tmp_path / "run", failures=len(chaos.KINDS), seed=0,
                             kinds=chaos.KINDS, in_order=True, groups=3, steps=2500,
                             step_seconds=0.1, gap_s=(0.5, 1.0), deadline_s=250.0,
                             max_restarts=16, cluster=cluster.run_id)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [], report["checks"]
    whats = [f["what"] for f in report["failures"]]
    assert [k for k in chaos.KINDS if FIRST_ENTRY[k] not in whats] == [], whats
    assert all("198.18.0." in c for c in report["commands"][1:]), report["commands"]
    assert report["left_running"] == []
