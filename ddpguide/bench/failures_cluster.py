"""Chapter 17's recovery on chapter 15's cluster, beside chapter 4's: one link lost, both ways.

On one cluster of 2 nodes (one rank each, 1 Gbit/s links), in one run, the same failure
(node 1's link taken down under a running job):

- torchft (``ft_train.py`` under the engine, ``Settings.cluster``: group g on node g, the
  lighthouse on node 0): node 1's link down past the timeouts, then up (chaos kind
  ``link``). ``ft_s`` is what it costs the survivor, group 0: ``runs.lost_s``, its commits
  around the cut less the ordinary steps between. Predicted as a hang's stall
  (``failures.stall_predicted_s``).
- torchrun (chapter 4's ``elastic_train.py`` under its c10d rendezvous on both nodes,
  ``cluster_elastic.lose_node_by_link``): node 1's link down for good; node 0's workers fail
  their all-reduce after the process group's timeout, its agent restarts them alone and they
  reload the checkpoint. ``torchrun_s``, measured as ``ft_s`` is: the gap between the last
  epoch logged before the cut and the first one of the new world, less one ordinary epoch.

Both use the same collective timeout (the engine's ``timeout_s``). The models differ (each
chapter's own program); what is compared is what a lost link costs the survivors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddpguide.bench.cluster_elastic import lose_node_by_link
from ddpguide.bench.report import Report
from ddpguide.cluster.cluster import up
from ddpguide.cluster.spec import Spec

ANCHORS = {
    "torchrun_over_ft_recovery_cluster": (
        "a lost link on the 2-node cluster: torchrun's restart (elastic_train.py) / torchft's "
        "stall (ft_train.py), same collective timeout, in one run", "", ">= 5"),
    "stall_measured_over_predicted_link": (
        "survivor's stall after a cut link (cluster) / a hang's prediction", "torchft lighthouse",
        "0.8-1.25"),
}


def torchrun_lost_s(result: dict) -> float:
    """From ``lose_node_by_link``'s timeline: the last epoch before the cut to the first of the
    new world, less one ordinary epoch (the median gap between epochs before the cut)."""
    from ddpguide.failures.runs import step_interval_s

    down = next(e["t"] for e in result["timeline"] if e["event"] == "link down")
    epochs = [e for e in result["timeline"] if e["event"] == "epoch"]
    before = [e["t"] for e in epochs if e["t"] <= down and e["world_size"] == epochs[0]["world_size"]]
    after = [e["t"] for e in epochs if e["world_size"] != epochs[0]["world_size"]]
    if not (before and after):
        raise RuntimeError(f"no epoch on both sides of the link loss: {result['timeline']}")
    return after[0] - before[-1] - step_interval_s(before)


def run(report: Report, folder: Path, settings, stall_predicted_s: Callable) -> None:
    """Both runs on one cluster; adds their parts and ``torchrun_over_ft_recovery_cluster``
    (the stall predicted by ``failures.stall_predicted_s``, given, as that module imports this)."""
    from ddpguide.failures import run as ft

    with up(Spec(nodes=2, ranks_per_node=1, link="1gbit"), holder="bench failures") as cluster:
        placed = settings.__class__(**{**settings.__dict__, "cluster": cluster.run_id})
        chaos_run = ft.run(placed, folder, failures=1, seed=1, kinds=("link",), gap_s=(0.5, 1.0))
        elastic = lose_node_by_link(cluster, pg_timeout=float(settings.timeout_s))
    failed = [c["name"] for c in chaos_run["checks"] if not c["ok"]]
    cuts = [f for f in chaos_run["failures"] if f["what"] == "link down"]
    if failed or not cuts:
        raise RuntimeError(f"the cluster's chaos run: failed checks {failed}, failures "
                           f"{chaos_run['failures']}")
    from ddpguide.failures.runs import lost_s

    ft_s, predicted = lost_s(chaos_run, cuts[0]), stall_predicted_s(chaos_run, cuts[0], settings)
    if ft_s is None:
        raise RuntimeError("the survivor committed nothing on one side of the cut link")
    torchrun_s = torchrun_lost_s(elastic)
    report.add("ft lost per link loss (cluster)", ft_s, "s", predicted_s=predicted,
               commands=chaos_run["commands"], seconds=chaos_run["seconds"])
    report.add("torchrun lost per link loss (cluster)", torchrun_s, "s",
               returncodes=elastic["returncodes"], errors=elastic["errors"],
               command=elastic["command"], process_group_timeout=elastic["pg_timeout"],
               timeline=elastic["timeline"])
    report.ratios["stall_measured_over_predicted_link"] = ft_s / predicted
    report.ratios["torchrun_over_ft_recovery_cluster"] = torchrun_s / ft_s
