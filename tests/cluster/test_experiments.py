"""The chapter's programs on a real 2 x 2 cluster, and the bench suite's quick run (slow:
each torchrun start on the shared cores takes tens of seconds)."""

from __future__ import annotations

import math

import pytest

from ddpguide.bench import cluster as suite
from ddpguide.cluster import Spec, netns, up
from ddpguide.cluster.experiments import ProgramFailed, run_program
from ddpguide.cluster.launch import torchrun_argv, torchrun_on
from ddpguide.launch import report as reports
from ddpguide.launch.programs import path_of

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(netns.missing_prerequisite() is not None,
                                 reason=str(netns.missing_prerequisite()))]


def test_torchrun_argv_is_the_command_a_reader_types():
    with up(Spec(nodes=2, ranks_per_node=2, link="1gbit")) as cluster:
        argv = torchrun_argv(cluster, 1, ["train.py", "--steps", "2"])
        assert argv[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                            "--node-rank", "1", "--rdzv-endpoint", "198.18.0.1:29500",
                            "train.py", "--steps", "2"]
        assert cluster.env(cluster.nodes[1])["GLOO_SOCKET_IFNAME"] == cluster.nodes[1].ifname


GPT = str(path_of("gpt/train.py"))
SMALL = ["--dim", "32", "--heads", "4", "--layers", "2", "--seq", "16", "--steps", "2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [["--dp-replicate", "2", "--dp-shard", "2"], ["--dp-shard", "4"]],
                         ids=["hsdp", "fsdp2"])
def test_the_gpt_runs_unchanged_on_two_nodes(layout, tmp_path):
    with up(Spec(nodes=2, ranks_per_node=2, link="1gbit")) as cluster:
        ended = torchrun_on(cluster, [GPT, *layout, *SMALL, "--report", str(tmp_path / "gpt.json")], 600,
                            cwd=tmp_path)
        assert [e.returncode for e in ended] == [0, 0], ended[0].errors[-2000:]
        with pytest.raises(ProgramFailed, match="exit"):
            run_program(cluster, path_of("gpt/train.py"), ["--tp", "3"], 300)  # a bad layout: exit 2 on every node
    losses = reports.read(tmp_path / "gpt.json", "gpt/train.py on two nodes")["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_and_fsdp2_programs_run_unchanged_on_two_nodes(tmp_path):
    with up(Spec(nodes=2, ranks_per_node=2, link="1gbit")) as cluster:
        fsdp2 = run_program(cluster, path_of("fsdp2.py"), [], 600)
        ended = torchrun_on(cluster, [str(path_of("ddp_torchrun.py")), "--epochs", "1", "--checkpoint",
                                      str(tmp_path / "ckpt.pt"), "--report", str(tmp_path / "ddp.json")],
                            600, cwd=tmp_path)
        assert [e.returncode for e in ended] == [0, 0], ended[0].errors[-2000:]
    assert fsdp2["checks"] and all(check["ok"] for check in fsdp2["checks"])
    assert reports.read(tmp_path / "ddp.json")["world_size"] == 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick_run_counts_the_formulas():
    report = suite.run(quick=True)
    ratios = report.ratios
    assert 0.9 <= ratios["link_bandwidth_measured_over_configured"] <= 1.1
    for case in ("ring", "hierarchical", "all_gather", "reduce_scatter", "fsdp2", "hsdp"):
        assert abs(ratios[f"inter_node_bytes_counted_over_formula_{case}"] - 1) <= 0.02, case
    assert ratios["hierarchical_sum_equals_flat"] == 1.0
    assert ratios["doctor_names_the_slow_node"] == 1.0
    assert ratios["elastic_link_loss_every_epoch_once"] == 1.0


@pytest.mark.slow
def test_a_dead_link_makes_gloo_raise_after_the_process_group_timeout():
    from ddpguide.cluster.faults import dead_link

    with up(Spec(nodes=2, ranks_per_node=1, link="100mbit")) as cluster:
        result = dead_link(cluster, pg_timeout=5.0)
    assert result["returncodes"][1] == 1
    assert all("Timed out waiting 5000ms for recv operation to complete" in e for e in result["errors"])
    assert [r["rank"] for r in result["reports"]] == [0, 1]
    assert all(5.0 <= r["raised_after_s"] and r["steps"] >= 3 for r in result["reports"])
