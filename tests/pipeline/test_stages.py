"""The multi-process pipeline: stages, library schedules and the hand-written GPipe.

Every pipeline step is compared with the unsplit ResNet50 (32x32, batch 8).
Forward equality with the full batch holds in eval mode; in train mode the
reference is gradient accumulation over the same micro-batches, computed here
with one thread like the ranks (train-mode BatchNorm on a random ResNet50
amplifies rounding, so even another thread count changes its gradients).
"""

from __future__ import annotations

import pytest
import torch

from ddpguide.launch.spawn import WorkerError, spawn
from ddpguide.pipeline import schedules, zoo
from ddpguide.pipeline import stages as pp
from ddpguide.pipeline.model_parallel import max_scaled_error, microbatch_reference

TOL = 1e-5
BATCH = 8


def stage_order(schedule: str, p: int, m: int) -> list[list[str]]:
    """Each stage's order as the simulator plays it (``zoo.compute_actions``), as ``F0``, ``B0``..."""
    name = {"gpipe": "GPipe", "1f1b": "1F1B"}[schedule]
    return [[f"{op.kind}{op.mb}" for op in ops] for ops in zoo.compute_actions(name, p, m)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 3, 32, 32, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def reference(x, y, split_size: int | None = None, train_mode: bool = False):
    """(output, loss, grads) of the unsplit model: full batch, or accumulated micro-batches."""
    model = pp.build_resnet50(seed=0).train(train_mode)
    loss_fn = pp.batch_loss(x.shape[0])
    if split_size is None:
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
    else:
        out, loss = microbatch_reference(model, x, y, split_size, loss_fn)
    return out.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def full_batch(data):
    return reference(*data)


def run_pipeline(kind, x, y, split_size, world_size=2, **kwargs):
    # gloo on the CPU, like the reference: one thread, the same kernels.
    results = spawn(schedules.pipeline_worker, world_size, kind, x, y, split_size, kwargs=kwargs,
                    backend="gloo", threads_per_rank=1, timeout=90, collective_timeout=30, echo=False)
    grads = {}
    for r in results:
        assert not grads.keys() & r["grads"].keys(), "a parameter got gradients on two ranks"
        grads.update(r["grads"])
    return results[-1]["output"], results[-1]["loss"], grads, [r["order"] for r in results]


def assert_matches(result, expected):
    out, loss, grads, _ = result
    assert out.shape == expected[0].shape
    assert max_scaled_error(out, expected[0]) <= TOL
    assert max_scaled_error(loss, expected[1]) <= TOL
    assert max_scaled_error(grads, expected[2]) <= TOL


# ----------------------------------------------------------------------------- splitting

def test_resnet50_blocks_and_the_seed_split():
    model = pp.build_resnet50()
    names = [n for n, _ in pp.model_blocks(model)]
    assert len(names) == 18 and names[0] == "stem" and names[-1] == "head"
    assert names.index(pp.SEED_SPLIT) == 8  # stem + 3 layer1 + 4 layer2 blocks
    first, second = pp.split_model(model)
    assert list(first.named_children())[-1][0] == "layer2_3"
    assert list(second.named_children())[0][0] == "layer3_0"
    own = {id(p) for p in model.parameters()}
    assert {id(p) for s in (first, second) for p in s.parameters()} == own


def test_stages_compose_to_the_model(data):
    x, _ = data
    model = pp.build_resnet50().eval()
    with torch.no_grad():
        expected = model(x)
        for points in (["layer3.1"], [9], ["layer2.0", "layer4.0"]):
            out = x
            for stage in pp.split_model(model, points):
                out = stage(out)
            assert torch.equal(out, expected), points


def test_split_points_are_checked():
    model = pp.build_resnet50()
    with pytest.raises(ValueError, match="^no block named 'layer5.0'; blocks are stem, layer1.0"):
        pp.split_model(model, ["layer5.0"])
    with pytest.raises(ValueError, match="^split point 18 must be between 1 and 17$"):
        pp.split_model(model, [18])
    with pytest.raises(ValueError, match="^split points must be increasing and distinct"):
        pp.split_model(model, ["layer3.0", "layer2.0"])
    with pytest.raises(TypeError, match="^cannot split a Linear"):
        pp.model_blocks(torch.nn.Linear(2, 2))


def test_balanced_split_minimises_the_slowest_stage():
    assert pp.balanced_split([1, 1, 1, 1, 4]) == [4]
    assert pp.balanced_split([3, 1, 1, 1]) == [1]
    assert pp.balanced_split([1, 2, 3, 4, 5, 6], 3) == [3, 5]
    with pytest.raises(ValueError, match="^cannot cut 2 blocks into 3 stages$"):
        pp.balanced_split([1, 1], 3)


def test_microbatch_counts_and_the_library_shape_rule():
    assert pp.num_microbatches(8, 3) == 3 and pp.num_microbatches(8, 20) == 1
    schedules.check_equal_microbatches(8, 4)
    schedules.check_equal_microbatches(8, 20)
    with pytest.raises(ValueError) as info:
        schedules.check_equal_microbatches(8, 3)
    assert str(info.value) == (
        "torch.distributed.pipelining needs equal micro-batches: split_size 3 does not divide "
        "the batch of 8 (the hand-written GPipe accepts it)"
    )
    for bad in (0, -1):
        with pytest.raises(ValueError) as info:
            pp.num_microbatches(8, bad)
        assert str(info.value) == f"split_size must be a positive integer, got {bad}"


# ----------------------------------------------------------------------------- two processes

@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "hand-gpipe"])
def test_pipeline_matches_the_unsplit_model(kind, data, full_batch):
    result = run_pipeline(kind, *data, split_size=2, steps=2)
    assert_matches(result, full_batch)
    # What ran is the schedule the visualiser draws (second step: no shape inference).
    schedule = "gpipe" if kind == "hand-gpipe" else kind
    assert result[3] == stage_order(schedule, 2, 4)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind,split_size", [("hand-gpipe", 3), ("hand-gpipe", 20), ("gpipe", 20)],
                         ids=["hand-ragged", "hand-larger-than-batch", "gpipe-larger-than-batch"])
def test_pipeline_edge_split_sizes(kind, split_size, data, full_batch):
    assert_matches(run_pipeline(kind, *data, split_size=split_size), full_batch)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["1f1b", "hand-gpipe"])
def test_train_mode_pipeline_is_microbatch_accumulation(kind, data):
    expected = reference(*data, split_size=4, train_mode=True)
    assert_matches(run_pipeline(kind, *data, split_size=4, train_mode=True), expected)


@pytest.mark.timeout(150)
def test_three_stage_1f1b_runs_the_visualised_order(data, full_batch):
    result = run_pipeline("1f1b", *data, split_size=2, world_size=3,
                          split_points=["layer2.0", "layer3.2"], steps=2)
    assert_matches(result, full_batch)
    assert result[3] == stage_order("1f1b", 3, 4)


@pytest.mark.timeout(150)
def test_library_pipeline_rejects_ragged_microbatches_before_communicating(data):
    with pytest.raises(WorkerError, match="split_size 3 does not divide the batch of 8"):
        run_pipeline("1f1b", *data, split_size=3)


# ----------------------------------------------------------------------------- performance facts

def test_small_batches_on_one_thread_use_the_slow_convolution():
    from ddpguide.bench.pipeline_timing import count_slow_conv2d

    model = pp.build_resnet50().eval()
    # 33 unstrided 1x1 convolutions in ResNet50 leave oneDNN below 16 samples on one thread
    assert count_slow_conv2d(model, torch.randn(15, 3, 32, 32)) == 33
    assert count_slow_conv2d(model, torch.randn(16, 3, 32, 32)) == 0


def test_time_blocks_gives_one_positive_time_per_block(data):
    from ddpguide.bench.pipeline_timing import time_blocks

    model = pp.build_resnet50()
    times = time_blocks(model, data[0][:4], repeats=1)
    assert len(times) == 18 and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_benchmark_reports_the_promised_ratios(tmp_path):
    from ddpguide.bench import pipeline as bench

    report = bench.run(quick=True, image_size=32, batch_size=16, plot_path=str(tmp_path / "sweep.png"))
    assert set(report.ratios) >= {"pipeline_speedup", "pipeline_speedup_balanced",
                                  "model_parallel_over_single", "bubble_efficiency"}
    # the share of chapter 13's steps that ran quiet is 0 when the machine was busy throughout
    # (the report then says that its figures are the machine's); every other ratio is a time ratio
    assert 0 <= report.ratios["quiet_step_share"] <= 1
    assert all(v > 0 for k, v in report.ratios.items() if k != "quiet_step_share"), report.ratios
    assert report.ratios["bubble_efficiency"] == pytest.approx(report.ratios["pipeline_speedup"] / 2)
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert any(str(tmp_path / "sweep.png") in note for note in report.notes)
    report.write_json(tmp_path / "pipeline.json")


def test_channels_last_stages_compute_the_same_and_send_contiguous_tensors(data):
    from ddpguide.bench.pipeline_cases import channels_last_stages

    x, y = data
    model = pp.build_resnet50().eval()
    expected = reference(x, y)
    first, second = channels_last_stages(pp.split_model(model))
    boundary = first(x.contiguous(memory_format=torch.channels_last))
    assert boundary.is_contiguous()                       # what gloo can send
    received = boundary.detach().requires_grad_()
    out = second(received)
    loss = pp.batch_loss(BATCH)(out, y)
    loss.backward()
    assert received.grad.is_contiguous()                  # the gradient sent back
    boundary.backward(received.grad)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert max_scaled_error(out, expected[0]) <= TOL
    assert max_scaled_error(grads, expected[2]) <= TOL
