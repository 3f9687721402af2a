"""A cluster on one machine: the link's alpha-beta, bytes on the link, times and overlap.

``python -m ddpguide.bench cluster [--quick] [--json FILE]`` (root, iproute2)

Two nodes (network namespaces) joined through a bridge by links that ``tc tbf``
limits (:mod:`ddpguide.cluster`), the chapter's programs started on both by
``torchrun --nnodes 2``:

* ``book/programs/cluster/collectives.py`` on 2 nodes x 2 ranks at ``LINK``:
  a ping-pong of small messages (latency) and a point-to-point sweep (bandwidth) across
  the link and inside a node, a flat
  ring all-reduce and the hierarchical one, an all-gather and a reduce-scatter;
* ``book/programs/cluster/sharding.py``: FSDP2 over all 4 ranks, and HSDP;
* ``book/programs/cluster/ddp_overlap.py`` on 2 nodes x 1 rank, node 1's link at
  ``SLOW_LINK``: DDP with small buckets and with one bucket;
* ``book/programs/cluster/dead_link.py``: node 1's link taken down under a loop of
  all-reduces; how long gloo waits before it raises;
* on 3 nodes x 1 rank, node 1's link at ``DOCTOR_SLOW_LINK``: ``python -m
  ddpguide.doctor`` under torchrun across the nodes, which must name node 1's link; then
  chapter 4's ``elastic_train.py`` under torchrun's c10d rendezvous (at node 0, whose
  agent hosts the store), node 2's link taken down mid-run: nodes 0 and 1 go on.

Bytes are the TCP payload counted by the interfaces themselves
(``tx_bytes - 66 tx_packets``), less the control messages of the barriers around
a phase (the ``barrier`` phase, counted alike). Time predictions use only the sweeps
and the parts timed alone, never the run they predict.
"""

from __future__ import annotations

import statistics

from ddpguide.bench.cluster_elastic import lose_node_by_link
from ddpguide.bench.report import Report
from ddpguide.cluster import Spec, up
from ddpguide.cluster import model as formulas
from ddpguide.cluster.experiments import collectives, ddp_overlap, doctor, sharding
from ddpguide.cluster.faults import dead_link
from ddpguide.cluster.netns import burst_bytes
from ddpguide.cluster.spec import parse_rate

LINK, SLOW_LINK, DOCTOR_SLOW_LINK = "50mbit", "20mbit", "50mbit"
DEAD_LINK_TIMEOUT = LINK_LOSS_TIMEOUT = 10.0
#: ratio -> (meaning, reference, goal): the appendix's anchors of this suite.
ANCHORS: dict[str, tuple[str, str, str]] = {
    "link_bandwidth_measured_over_configured": (
        "beta fitted from a point-to-point sweep across the link (TCP payload) / the tbf rate",
        "1448/1514 = 0.956: the payload share of a full Ethernet frame", "0.9-1.1"),
    **{f"inter_node_bytes_counted_over_formula_{key}": (
        f"payload counted by the interfaces (tx_bytes - 66 tx_packets, less the barriers') / "
        f"the formula, {name}", "", "1.00 +- 0.02")
       for key, name in (("ring", "flat ring all-reduce"), ("hierarchical", "hierarchical all-reduce"),
                         ("all_gather", "ring all-gather"), ("reduce_scatter", "gloo reduce-scatter"),
                         ("fsdp2", "FSDP2 step over 4 ranks"), ("hsdp", "HSDP step 2 x 2"))},
    "inter_node_bytes_counted_over_formula": ("the case above farthest from 1", "", "1.00 +- 0.02"),
    "hierarchical_over_flat_time_measured": ("hierarchical / flat all-reduce time, 2 x 2 ranks",
                                                   "", "< 1"),
    "hierarchical_over_flat_time_predicted": (
        "the same, from the latency (ping-pong) and bandwidth (sweep) of each link, gloo's "
        "reduce-scatter as an all-reduce", "", ""),
    "link_intercept_over_burst": (
        "the sweep's intercept / -burst / rate: tbf's bucket passes its first bytes at once",
        "netns.burst_bytes: 64 KiB at 50 Mbit/s", "0.8-1.25"),
    "hierarchical_over_flat_time_measured_over_predicted": (
        "measured ratio / predicted ratio", "", "0.8-1.25"),
    "flat_time_measured_over_predicted": ("flat all-reduce time / alpha-beta prediction", "", ""),
    "hierarchical_sum_equals_flat": ("1 when both sums are bitwise equal", "", "1"),
    "exposed_comm_measured_over_predicted_small_buckets": (
        "median of (DDP step - no_sync step), taken in turns / bucket pipeline prediction from "
        "the buckets all-reduced alone, 16 buckets, slow link", "", "0.8-1.25"),
    "exposed_comm_measured_over_predicted_one_bucket": (
        "the same, one bucket (nothing overlaps: exposed = the all-reduce alone)", "", "0.8-1.25"),
    "exposed_comm_measured_over_predicted": ("the case above farthest from 1", "", "0.8-1.25"),
    "dead_link_error_after_over_timeout": (
        "seconds from the last good all-reduce to gloo's error, node 1's link taken down / the "
        "process group's timeout", "gloo tcp/unbound_buffer.cc: 'Timed out waiting ...ms for recv'",
        "1.0"),
    "doctor_names_the_slow_node": (
        "1 when the doctor across 3 nodes names node 1's link, and only it", "", "1"),
    "elastic_link_loss_every_epoch_once": (
        "1 when nodes 0 and 1 finish after node 2's link went down, every epoch logged once, "
        "at world size 3 before and 2 after", "", "1"),
}


def worst(values: dict[str, float]) -> float:
    """The value farthest from 1 (a suite-level figure that every case must meet)."""
    return max(values.values(), key=lambda v: abs(v - 1.0))


def add_collectives(report: Report, result: dict, rate_bits: int) -> None:
    intercept, beta = formulas.fit_alpha_beta(
        [(p["bytes"], p["seconds"]) for p in result["sweep"]])
    intercept_in, beta_in = formulas.fit_alpha_beta(
        [(p["bytes"], p["seconds"]) for p in result["intra_sweep"]])
    alpha, alpha_in = result["latency"]["across"], result["latency"]["inside"]
    burst = formulas.burst_intercept(burst_bytes(rate_bits), rate_bits / 8)
    report.add("link_latency", alpha * 1e6, "us", inside_node_us=alpha_in * 1e6)
    report.add("link_intercept", intercept * 1e3, "ms", fit_points=result["sweep"],
               burst_ms=burst * 1e3)
    report.add("link_beta", beta / 1e6, "MB/s", configured_mb_s=rate_bits / 8e6)
    report.add("intra_node_beta", beta_in / 1e6, "MB/s", intercept_ms=intercept_in * 1e3)
    report.ratios["link_bandwidth_measured_over_configured"] = beta * 8 / rate_bits
    report.ratios["link_intercept_over_burst"] = intercept / burst
    n_bytes = result["numel"] * result["element_bytes"]
    ranks, nodes, local = result["world"], result["nodes"], result["local_world"]
    overhead = statistics.fmean(result["barrier"]["payload_per_node"])
    formulas_of = {
        "ring": ("flat", formulas.ring_all_reduce_bytes(n_bytes, ranks)),
        "hierarchical": ("hierarchical", formulas.hierarchical_bytes(n_bytes, nodes)),
        "all_gather": ("all_gather", formulas.ring_all_gather_bytes(n_bytes, ranks)),
        "reduce_scatter": ("reduce_scatter", formulas.ring_all_reduce_bytes(n_bytes, ranks)),
    }
    for case, (phase, formula) in formulas_of.items():
        counted = statistics.fmean(result[phase]["payload_per_node"]) - overhead
        report.add(f"{case}_bytes_per_node", counted, "B", formula=formula,
                   per_node=result[phase]["payload_per_node"], barrier_overhead=overhead)
        report.ratios[f"inter_node_bytes_counted_over_formula_{case}"] = counted / formula
    flat_s, hier_s = result["flat"]["seconds"], result["hierarchical"]["seconds"]
    flat_pred = formulas.flat_time(n_bytes, ranks, alpha, beta)
    hier_pred = formulas.hierarchical_time(n_bytes, nodes, local, alpha, beta, alpha_in, beta_in)
    report.add("flat_seconds", flat_s, "s", predicted=flat_pred)
    report.add("hierarchical_seconds", hier_s, "s", predicted=hier_pred)
    report.ratios["hierarchical_over_flat_time_measured"] = hier_s / flat_s
    report.ratios["hierarchical_over_flat_time_predicted"] = hier_pred / flat_pred
    report.ratios["hierarchical_over_flat_time_measured_over_predicted"] = (
        (hier_s / flat_s) / (hier_pred / flat_pred))
    report.ratios["flat_time_measured_over_predicted"] = flat_s / flat_pred
    report.ratios["hierarchical_sum_equals_flat"] = float(result["same_sum"])


def add_sharding(report: Report, result: dict, overhead: float) -> None:
    layout, steps, p_bytes = result["layout"], result["steps"], result["param_bytes"]
    if layout == "fsdp":
        formula = steps * formulas.fsdp_step_bytes(p_bytes, result["world"])
    else:
        formula = steps * formulas.hsdp_step_bytes(p_bytes, result["nodes"])
    counted = statistics.fmean(result["payload_per_node"]) - overhead
    name = "fsdp2" if layout == "fsdp" else "hsdp"
    report.add(f"{name}_bytes_per_node", counted, "B", formula=formula, steps=steps,
               param_bytes=p_bytes, per_node=result["payload_per_node"])
    report.ratios[f"inter_node_bytes_counted_over_formula_{name}"] = counted / formula


def add_overlap(report: Report, runs: list[dict]) -> None:
    for run in runs:
        case = "small_buckets" if len(run["buckets"]) > 1 else "one_bucket"
        predicted = formulas.exposed_prediction(run)
        report.add(f"exposed_{case}", run["exposed_seconds"], "s", predicted=predicted,
                   buckets=run["buckets"], compute=run["compute_seconds"],
                   comm_alone=run["comm_seconds"], step=run["step_seconds"],
                   forward=run["forward_seconds"])
        report.ratios[f"exposed_comm_measured_over_predicted_{case}"] = (
            run["exposed_seconds"] / predicted["bucketed"] if predicted["bucketed"] > 0 else float("nan"))


def add_dead_link(report: Report, result: dict) -> None:
    waited = [r["raised_after_s"] for r in result["reports"] if r["raised_after_s"] is not None]
    report.add("dead_link_error_after", max(waited) if waited else float("nan"), "s",
               errors=result["errors"], returncodes=result["returncodes"],
               process_group_timeout=DEAD_LINK_TIMEOUT)
    report.ratios["dead_link_error_after_over_timeout"] = (
        max(waited) / DEAD_LINK_TIMEOUT if waited else float("nan"))


def add_doctor(report: Report, result: dict) -> None:
    problems = (result["report"] or {}).get("problems", [])
    report.add("doctor_across_nodes", float(len(problems)), "problems", lines=result["lines"],
               returncodes=result["returncodes"], command=result["command"],
               hosts=((result["report"] or {}).get("links") or {}).get("hosts"))
    report.ratios["doctor_names_the_slow_node"] = float(
        [(p["host"], p["message"].startswith("slow link: host node1 ")) for p in problems]
        == [("node1", True)])


def add_link_loss(report: Report, result: dict) -> None:
    down = next(e["t"] for e in result["timeline"] if e["event"] == "link down")
    epochs = [e for e in result["timeline"] if e["event"] == "epoch"]
    # an epoch whose all-reduces were done may still be logged after the link went down
    after = [e for e in epochs if e["world_size"] != epochs[0]["world_size"]]
    sizes = [(r["world_size"], r["restart_count"]) for r in result["records"]]
    lost_at = next((i for i, size in enumerate(sizes) if size != sizes[0]), len(sizes))
    report.add("elastic_link_loss_first_epoch_after", after[0]["t"] - down if after else float("nan"),
               "s", timeline=result["timeline"], returncodes=result["returncodes"],
               errors=result["errors"], command=result["command"],
               process_group_timeout=result["pg_timeout"])
    survivors = [c for k, c in enumerate(result["returncodes"]) if k != result["lost"]]
    report.ratios["elastic_link_loss_every_epoch_once"] = float(
        survivors == [0] * len(survivors)
        and [r["epoch"] for r in result["records"]] == list(range(result["epochs"]))
        and set(sizes[:lost_at]) == {(3, 0)} and set(sizes[lost_at:]) == {(2, 1)})


def run(quick: bool = False) -> Report:
    report = Report("cluster")
    numel, sizes, repeats = (2**19, (2**20, 2**21, 2**22), 2) if quick else (
        2**21, (2**20, 2**21, 2**22, 2**23), 3)
    with up(Spec(nodes=2, ranks_per_node=2, link=LINK)) as cluster:
        result = collectives(cluster, numel=numel, sizes=sizes, repeats=repeats)
        add_collectives(report, result, parse_rate(LINK))
        overhead = statistics.fmean(result["barrier"]["payload_per_node"])
        for layout in ("fsdp", "hsdp"):
            add_sharding(report, sharding(cluster, layout, width=256 if quick else 512), overhead)
    with up(Spec(nodes=2, ranks_per_node=1, link="1gbit", slow_node=1,
                 slow_link=SLOW_LINK)) as cluster:
        add_overlap(report, ddp_overlap(cluster, steps=3 if quick else 5))
        add_dead_link(report, dead_link(cluster, pg_timeout=DEAD_LINK_TIMEOUT))
    with up(Spec(nodes=3, ranks_per_node=1, link="1gbit", slow_node=1,
                 slow_link=DOCTOR_SLOW_LINK)) as cluster:
        add_doctor(report, doctor(cluster))
        add_link_loss(report, lose_node_by_link(cluster, pg_timeout=LINK_LOSS_TIMEOUT))
    bytes_ratios = {k: v for k, v in report.ratios.items()
                    if k.startswith("inter_node_bytes_counted_over_formula_")}
    report.ratios["inter_node_bytes_counted_over_formula"] = worst(bytes_ratios)
    exposed = {k: v for k, v in report.ratios.items() if k.startswith("exposed_comm_measured_")}
    report.ratios["exposed_comm_measured_over_predicted"] = worst(exposed)
    report.notes.append(
        f"links limited by tc tbf ({LINK}; DDP over node 1's {SLOW_LINK} link), no added delay "
        "(netem missing): latency is the kernel's; bytes are TCP payload counted by the "
        "interfaces, less the barriers' control messages; ranks of one node share loopback; "
        "the CPU is shared with other work (load at start in load_at_start)")
    return report
