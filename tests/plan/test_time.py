"""Chapter 16: the time model of plan_cost.py, piece by piece, against what it stands for: the
pipeline order against torch's own schedule, the simulation against the 1F1B formula and
against the cores the ranks share, a link's sharing and burst, gloo's reduce-scatter, the
sweep's fit, the collectives train.py calls around and in a pass, and the saved cluster run
ranked again by the program as it is now."""

from __future__ import annotations

import math

import pytest

from ddpguide.launch.programs import load
from ddpguide.plan import catalog, checks, hardware, saved, search


@pytest.fixture(scope="module")
def p():
    return search.program()


def _cluster(p, **changes):
    """The emulated cluster's kind of hardware: 2 ranks a node, one link a node, gloo."""
    hw = p.Hardware(gpus_per_node=2, nics=1, backend="gloo", streams=False, overlap=True,
                    links={"node": [1e-4, 1e-9, 0.0], "net": [5e-4, 4e-7, 65536.0]})
    for key, value in changes.items():
        setattr(hw, key, value)
    return hw


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 4), (4, 8), (3, 5)])
def test_order_is_torchs(p, schedule, stages, microbatches):
    """The order each stage runs its forwards and backwards in is torch's schedule IR
    (_get_pipeline_order). For 1F1B's last stage torch 2.14.1's IR numbers the micro-batches
    from 1 (F1, B0, F2, ...) while _step_microbatches, which runs, numbers them from 0: there
    the kinds are compared."""
    from torch.distributed.pipelining import schedules

    cls = schedules.Schedule1F1B if schedule == "1F1B" else schedules.ScheduleGPipe
    ir = cls.__new__(cls)
    ir._num_stages, ir._n_microbatches = stages, microbatches
    torch_order = ir._get_pipeline_order()
    for stage in range(stages):
        theirs = [(a.computation_type.value[0], a.microbatch_index) for a in torch_order[stage]
                  if a is not None and a.computation_type.value in ("F", "B")]
        ours = p.order(schedule, stages, stage, microbatches)
        if schedule == "1F1B" and stage == stages - 1:
            ours, theirs = [k for k, _ in ours], [k for k, _ in theirs]
        assert ours == theirs, (stage, theirs)


def test_simulated_1f1b_is_the_formula(p):
    """No communication, a device each: (m + p - 1) x (F + B) on the last stage to end."""
    F, B, m, stages = 1.0, 2.0, 6, 4
    plans = [[("work", F if kind == "F" else B) for kind, _ in p.order("1F1B", stages, s, m)] for s in range(stages)]
    for s in range(stages):  # the activations and gradients still have to arrive: zero-time sends
        plan = []
        for kind, i in p.order("1F1B", stages, s, m):
            up = kind == "F"
            if (s > 0 if up else s < stages - 1):
                plan.append(("recv", (kind, s, i)))
            plan.append(("work", F if up else B))
            to = s + 1 if up else s - 1
            if 0 <= to < stages:
                plan.append(("send", (kind, to, i), (kind, min(s, to)), 0.0))
        plans[s] = plan
    end, parts = p.simulate(plans, 1, 0.0)
    assert math.isclose(max(end), (m + stages - 1) * (F + B))
    # the step's "bubble" is seconds the last stage to end waits; over its compute seconds it is
    # chapters 5 and 13's bubble, idle over busy: (p - 1) / m
    last = max(range(stages), key=lambda s: end[s])
    assert math.isclose(parts[last]["bubble"] / parts[last]["compute"], (stages - 1) / m)


def test_shared_cores_fill_the_bubble(p):
    """4 ranks on 2 cores: a 2-stage pipeline takes its ranks' work over the cores, the bubble
    filled by the other stage (each stage has 2 ranks), not (m + 1) slots at half speed."""
    model, pol = catalog.model(p, "gpt", **checks.TIME_MODEL), catalog.policy(p, "float32")
    hw = _cluster(p, cores=2.0, links={"node": [0.0, 0.0, 0.0], "net": [0.0, 0.0, 0.0]},
                  matmul=[[64, 256, 256, 1e10]], bandwidth=1e10)
    lay = p.Layout(pp=2, dp_shard=2, microbatches=4)
    s = p.step(model, lay, pol, hw, 8, 64)
    work = [p.microbatch(model, lay, pol, hw, 1, 64, st) for st in range(2)]
    total = sum(4 * (w["forward"] + w["backward"]) for w in work) * 2  # 2 ranks a stage
    assert s["compute"] + s["bubble"] >= total / 2.0 * 0.999  # never faster than the cores allow
    assert s["compute"] + s["bubble"] < 5 / 4 * total / 2.0  # and far from 5 slots at half speed


def test_a_node_link_is_shared_by_its_groups(p):
    """FSDP over dp_shard with TP inside the node: two dp groups cross the one link at once."""
    hw = _cluster(p)
    assert p.link(hw, p.Layout(dp_shard=2, tp=2), ("tp",)) == ("node", 1.0)
    assert p.link(hw, p.Layout(dp_shard=2, tp=2), ("dp_shard",)) == ("net", 2.0)
    assert p.link(hw, p.Layout(dp_shard=4), ("dp_shard",)) == ("net", 1.0)  # one ring edge a node
    gpu = hardware.named(p, "H100", gpus_per_node=2)  # a NIC a GPU: nothing shared
    assert p.link(gpu, p.Layout(dp_shard=2, tp=2), ("dp_shard",)) == ("net", 1.0)


def test_collective_seconds(p):
    """alpha per message, beta per byte on the busiest link less the burst; gloo's reduce-scatter
    sends an all-reduce's bytes (chapter 15 counted it)."""
    hw, lay = _cluster(p), p.Layout(dp_shard=4)
    alpha, beta, burst = hw.links["net"]
    n = 2**20
    assert math.isclose(p.collective(hw, lay, "all_gather", n, ("dp_shard",)), 3 * alpha + beta * (0.75 * n - burst))
    assert math.isclose(p.collective(hw, lay, "reduce_scatter", n, ("dp_shard",)),
                        p.collective(hw, lay, "all_reduce", n, ("dp_shard",)))
    assert p.collective(hw, lay, "all_gather", 1000, ("dp_shard",), calls=3) == pytest.approx(3 * 3 * alpha)
    assert p.ring("reduce_scatter", 4) == (3, 0.75)  # nccl's


def test_fit_recovers_a_link():
    """The sweep's fit (plan_measure.py's): alpha, beta and a tbf burst back from exact samples of
    2-rank all-reduces."""
    fit = load(search.MEASURE).fit
    alpha, beta, burst = 4e-4, 4e-7, 65536
    samples = [(2, w, 2 * alpha + beta * max(0, w - burst)) for w in (1024, 16384, 32768, 65536, 131072,
                                                                         262144, 524288, 1048576)]
    got = fit(samples)
    assert got[0] == pytest.approx(alpha) and got[1] == pytest.approx(beta) and got[2] == burst


def test_saved_cluster_run_ranked_again():
    """The saved cluster run (book/measurements/plan.json): its measured hardware and steps, the
    predictions made again by the program as it is now (saved.rows). Spearman's rank
    correlation over the 14 layouts >= 0.8."""
    p = search.program()
    found = saved.rows(p, saved.load())
    assert len(found) == 14
    assert saved.ranking(found)["rank_correlation"] >= 0.8


def test_tensor_parallel_modules_cost_cpu_time(p):
    """Each tensor-parallel module (a block's six linears, two norms, two input redistributions;
    the embedding on the first stage, norm and head on the last) adds hw.tp_module_seconds to a
    micro-batch's forward and backward: a third forward, two thirds backward."""
    model, pol = catalog.model(p, "gpt", **checks.TIME_MODEL), catalog.policy(p, "float32")
    lay = p.Layout(pp=2, tp=2, microbatches=2)
    for stage, ends in ((0, 1), (1, 2)):
        base, extra = (p.microbatch(model, lay, pol, _cluster(p, tp_module_seconds=s), 4, 64, stage)
                       for s in (0.0, 1.0))
        assert extra["forward"] - base["forward"] == pytest.approx((10 + ends) / 3)
        assert extra["backward"] - base["backward"] == pytest.approx(2 * (10 + ends) / 3)


def test_collectives_after_and_in_the_pass_are_train_pys(p):
    """The calls train.py makes (its cost record's ``calls``), priced with latency alone (alpha
    1 s a message, 2 messages an all-reduce on 2 ranks). After the schedule: DDP averages the
    loss only (its gradients are whole: the norm needs no call); FSDP x TP sums the norms'
    five partial gradients over tp, the gradient norm over the FSDP ranks and over tp, and the
    loss. In a TP 2 forward: two gathers and two reduce-scatters a block (gloo's: an all-reduce,
    2 messages), the embedding's reduce-scatter, the head's gather, and loss_parallel's three
    all-reduces (a gathered loss: one all-gather of the logits instead)."""
    model, pol = catalog.model(p, "gpt-check"), catalog.policy(p, "float64")
    hw = _cluster(p, links={"node": [1.0, 0.0, 0.0], "net": [1.0, 0.0, 0.0]})
    assert p.step(model, p.Layout(dp_replicate=2), pol, hw, 8, 16)["sync"] == 2 * 1
    assert p.step(model, p.Layout(dp_shard=2, tp=2), pol, hw, 8, 16)["sync"] == 2 * (5 + 2 + 1)
    split, gathered = (p.microbatch_times(model, p.Layout(tp=2, loss_parallel=lp), pol, hw, 8, 16, 0)["forward_comm"]
                       for lp in (True, False))
    blocks = 2 * (2 * 1 + 2 * 2) + 2 + 1
    assert split == blocks + 3 * 2 and gathered == blocks + 1


@pytest.mark.parametrize("ac, share", [("none", 0.0), ("selective", 0.5), ("full", 1.0)])
def test_a_checkpointed_backward_runs_the_forward_again(p, ac, share):
    """Activation checkpointing adds the forward (selective: every other block's, half of it) to
    the backward, its compute and its calls. TP 2 on the first and last stage, latency alone:
    the backward's own calls are a block's two gathers and two reduce-scatters (gloo's: 2
    messages), the embedding's gather and the head's reduce-scatter, 15 messages; the forward's
    21 (the test above)."""
    model, pol = catalog.model(p, "gpt-check"), catalog.policy(p, "float64")
    hw = _cluster(p, links={"node": [1.0, 0.0, 0.0], "net": [1.0, 0.0, 0.0]})
    lay = p.Layout(tp=2, ac=ac)
    work = p.microbatch(model, lay, pol, hw, 8, 16, 0)
    timed = p.microbatch_times(model, lay, pol, hw, 8, 16, 0)
    assert timed["forward_comm"] == 21 and timed["backward_comm"] == 15 + share * 21
    assert timed["forward"] == work["forward"] and timed["backward"] == work["backward"] + share * work["forward"]
