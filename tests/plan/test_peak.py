"""The terms of plan_cost.memory and plan_step.at_peak that torch's own source puts at the peak,
each against a byte count made by hand for the checks' GPT (2 blocks, dim 32, vocabulary 256,
tied; float64; batch 8, sequence 16), and against torch's own code run on one rank (a gloo group
of one in this process): the term's bytes are what torch holds. The source lines are cited beside
each term, in plan_cost.py and plan_step.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpguide.plan import catalog, search

BATCH, SEQ, F64 = 8, 16, 8


@pytest.fixture(scope="module")
def p():
    return search.program()


@pytest.fixture(scope="module")
def gpt(p):
    return catalog.model(p, "gpt-check"), catalog.policy(p, "float64")


@pytest.fixture
def one_rank():
    """A gloo group of one rank in this process, and its one-rank device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_pipelines_last_stage_keeps_every_micro_batchs_logits(p, gpt):
    """PipelineStage.output_chunks: the last stage holds the logits of all its rows (every
    micro-batch's) until the next step; the other stages and a run without a pipeline none."""
    model, pol = gpt
    for axes, vocab in (({"pp": 2}, 256), ({"pp": 2, "tp": 2}, 128)):
        for schedule, m in (("1F1B", 2), ("GPipe", 4)):
            lay = p.Layout(**axes, microbatches=m, schedule=schedule)
            last = lay.world - 1
            logits = BATCH * SEQ * vocab * F64  # all 8 rows: m micro-batches of 8 / m rows each
            assert p.outputs(model, lay, pol, BATCH, SEQ, lay.pp - 1) == logits, (axes, schedule)
            assert p.outputs(model, lay, pol, BATCH, SEQ, 0) == 0
            assert p.at_peak(model, lay, pol, BATCH, SEQ, last)["outputs"] == logits
            assert p.at_peak(model, lay, pol, BATCH, SEQ, 0)["outputs"] == 0
    assert p.at_peak(model, p.Layout(tp=2), pol, BATCH, SEQ)["outputs"] == 0
    nanotron = p.Layout(pp=2, microbatches=2, engine="nanotron")  # its own engine keeps no outputs
    assert p.at_peak(model, nanotron, pol, BATCH, SEQ, 1)["outputs"] == 0


def test_loss_parallel_holds_three_logits_sized_gradients(p, gpt):
    """Eager, the loss's backward holds two logits-sized tensors (nll_loss's gradient and
    log-softmax's); loss_parallel's fused backward three (zeros_like, exp and their sum)."""
    model, pol = gpt
    shard = BATCH * SEQ * 128 * F64  # this rank's logits under TP 2: half the vocabulary
    assert p.memory(model, p.Layout(tp=2), pol, BATCH, SEQ)["temporaries"] == 3 * shard
    assert p.memory(model, p.Layout(tp=2, loss_parallel=False), pol, BATCH, SEQ)["temporaries"] == 2 * 2 * shard
    assert p.memory(model, p.Layout(), pol, BATCH, SEQ)["temporaries"] == 2 * 2 * shard
    assert p.at_peak(model, p.Layout(tp=2), pol, BATCH, SEQ)["temporaries"] == 3 * shard


def test_a_shard_group_of_one_still_holds_the_stage_unsharded(p, gpt):
    """PP x HSDP 2 x 2: FSDP2 on a shard group of one rank copies every shard into an unsharded
    buffer (wait_for_unshard's world_size == 1 path), and in a pipeline the stage stays gathered
    with its unsharded gradients: twice the stage's parameter bytes, as under PP x FSDP."""
    model, pol = gpt
    for axes in ({"dp_replicate": 2}, {"dp_shard": 2}):
        lay = p.Layout(pp=2, microbatches=2, **axes)
        for rank in range(lay.world):
            whole = sum(r * c for r, c, _ in p.stage_parameters(model, lay, p.coordinates(lay, rank)["pp"]))
            mem = p.memory(model, lay, pol, BATCH, SEQ, rank)
            assert mem["fsdp_unsharded"] == 2 * whole * F64, (axes, rank)
            assert p.at_peak(model, lay, pol, BATCH, SEQ, rank)["fsdp_unsharded"] == 2 * whole * F64
    # without a pipeline nothing changes: HSDP alone is DDP, and no shard group means no copy
    assert p.memory(model, p.Layout(dp_replicate=2), pol, BATCH, SEQ)["fsdp_unsharded"] == 0


def test_fsdp_in_a_pipeline_has_no_sharded_gradient_before_the_reduce_scatter(p, gpt):
    """Under FSDP a pipeline's micro-batches accumulate into the unsharded gradients; the sharded
    ones exist only after perform_reduce_grad, so the loss's backward holds none (a pipeline
    without FSDP holds the ones its earlier micro-batches made)."""
    model, pol = gpt
    for axes in ({"dp_replicate": 2}, {"dp_shard": 2}, {"cp": 2}):
        lay = p.Layout(pp=2, microbatches=2, **axes)
        for rank in range(lay.world):
            assert p.at_peak(model, lay, pol, BATCH, SEQ, rank)["gradients"] == 0, (axes, rank)
    lay = p.Layout(pp=2, tp=2, microbatches=2)
    last = p.memory(model, lay, pol, BATCH, SEQ, 3)
    assert p.at_peak(model, lay, pol, BATCH, SEQ, 3)["gradients"] == last["gradients"] > 0


def test_pp_x_tp_last_stage_by_hand(p, gpt):
    """PP x TP 2 x 2, 1F1B m2, the last stage at the loss's backward of its second micro-batch:
    the bytes the new terms add, by hand: both micro-batches' logits (4 rows x 16 tokens x 128
    of the vocabulary, float64, each) and a third logits-sized gradient of loss_parallel."""
    model, pol = gpt
    lay = p.Layout(pp=2, tp=2, microbatches=2)
    alive = p.at_peak(model, lay, pol, BATCH, SEQ, 3)
    logits = 4 * SEQ * 128 * F64
    assert alive["outputs"] == 2 * logits and alive["temporaries"] == 3 * logits
    assert alive["activations"] > 0 and alive["fsdp_unsharded"] == 0


def test_torchs_pipeline_stage_keeps_what_outputs_counts(p, gpt, one_rank):
    """A one-stage pipeline (the logits' layer alone) after its step: output_chunks holds every
    micro-batch's logits, the bytes plan_step.outputs counts for a last stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model, pol = gpt
    for schedule, m in ((ScheduleGPipe, 4), (Schedule1F1B, 2)):
        head = torch.nn.Linear(model.dim, model.vocab, bias=False, dtype=torch.float64)
        stage = PipelineStage(head, 0, 1, torch.device("cpu"))
        run = schedule(stage, m, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
        run.step(torch.randn(BATCH, SEQ, model.dim, dtype=torch.float64),
                 target=torch.randint(0, model.vocab, (BATCH, SEQ)))
        kept = sum(chunk.untyped_storage().nbytes() for chunk in stage.output_chunks)
        lay = p.Layout(pp=2, microbatches=m, schedule="GPipe" if schedule is ScheduleGPipe else "1F1B")
        assert len(stage.output_chunks) == m and kept == p.outputs(model, lay, pol, BATCH, SEQ, 1)


def test_torchs_loss_parallel_holds_what_loss_gradients_counts(p, gpt, one_rank):
    """The cross-entropy's backward under torch's MemTracker, vocabulary-sharded on a mesh of one
    under loss_parallel and plain: the temporaries at its peak are loss_gradients logits each."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    model, _ = gpt
    rows = BATCH * SEQ
    for lay in (p.Layout(tp=2), p.Layout()):
        logits = torch.randn(rows, model.vocab, dtype=torch.float64, requires_grad=True)
        target = torch.randint(0, model.vocab, (rows,))
        sharded = lay.tp > 1
        x = distribute_tensor(logits, one_rank, [Shard(1)]) if sharded else logits
        tracker = MemTracker()
        with tracker, (loss_parallel() if sharded else torch.enable_grad()):
            F.cross_entropy(x, target).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        temp = next(v for k, v in peak.items() if getattr(k, "value", k) == "Temp")
        assert round(temp / (rows * model.vocab * F64)) == p.loss_gradients(lay), (lay, temp)


def test_torchs_fsdp2_over_one_rank_holds_what_fsdp_unsharded_counts(p, gpt, one_rank):
    """FSDP2 on a mesh of one, as a pipeline's stage runs a micro-batch (reshard_after_forward
    and gradient sync off, no reshard after backward), under FSDPMemTracker: unsharded
    parameters and gradients beside the sharded ones, the bytes plan_cost.memory counts for PP x
    HSDP's stage, and no sharded gradient (at_peak counts none)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    _, pol = gpt
    net = torch.nn.Sequential(*(torch.nn.Linear(a, b, dtype=torch.float64) for a, b in ((32, 64), (64, 32))))
    for module in (*net, net):
        fully_shard(module, mesh=one_rank, reshard_after_forward=False)
    net.set_requires_gradient_sync(False)
    net.set_reshard_after_backward(False)
    tracker = FSDPMemTracker(net, torch.optim.AdamW(net.parameters()))
    with tracker:
        net(torch.randn(4, 32, dtype=torch.float64)).sum().backward()
        now = {str(getattr(k, "value", k)): v for k, v in tracker.get_tracker_snapshot()[torch.device("cpu")].items()}
    whole = sum(t.numel() for t in net.parameters())
    assert now["Sharded Param"] == whole * pol.param
    assert now["Unsharded Param"] + now["Unsharded Grad"] == whole * (pol.compute + pol.reduce)
    assert now.get("Sharded Grad", 0) == 0 and now.get("Gradient", 0) == 0
