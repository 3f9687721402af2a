"""The checklist of DDP mistakes: each check reproduces its symptom, fast and in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpguide.core.models import ToyModel
from ddpguide.ddp import pitfalls, pitfalls_data


def _one_line(finding: pitfalls.Finding) -> None:
    for text in (str(finding), finding.symptom, finding.fix):
        assert "\n" not in text and "Traceback" not in text, text


def test_missing_set_epoch_repeats_the_first_order():
    finding = pitfalls_data.check_set_epoch(dataset_size=8, world_size=2, epochs=3)
    assert finding.shown
    _one_line(finding)
    without, with_it = finding.details["without"], finding.details["with"]
    assert without[0] == without[1] == without[2]
    assert with_it[0] == without[0]  # epoch 0 is the same either way
    assert with_it[1] != with_it[0] and with_it[2] != with_it[1]
    for orders in (without, with_it):  # rank 0 always gets half the samples, each once
        assert all(len(set(order)) == 4 for order in orders)


def test_padding_repeats_and_drop_last_drops_samples():
    finding = pitfalls_data.check_padding(dataset_size=10, world_size=3)
    assert finding.shown
    _one_line(finding)
    assert finding.details["padded"] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert finding.details["drop_last"] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert finding.details["unpadded"] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert finding.symptom == "10 samples on 3 ranks: padding repeats 2, drop_last drops 1"


def test_forgotten_destroy_breaks_the_next_run_in_the_same_process():
    assert not dist.is_initialized()
    finding = pitfalls.check_destroy_process_group()
    assert finding.shown
    _one_line(finding)
    assert finding.details["error"] == "trying to initialize the default process group twice!"
    assert not dist.is_initialized()  # the check cleans up after itself


@pytest.mark.multiprocess
def test_loader_workers_need_a_generator_per_rank():
    finding = pitfalls_data.check_worker_seeds(world_size=2, num_workers=2)
    assert finding.shown
    _one_line(finding)
    without, with_it = finding.details["without"], finding.details["with"]
    assert without[0] == without[1]
    assert len(set(without[0])) == len(without[0])  # random within a rank, just not across
    assert with_it[0] != with_it[1]


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_every_rank_prints_and_saves_unless_guarded(capsys):
    finding = pitfalls.check_printing_and_saving(world_size=2)
    assert finding.shown
    _one_line(finding)
    assert finding.details == {"naive_prints": 2, "rank0_prints": 1, "naive_writers": 2,
                               "rank0_writers": 1}
    out = capsys.readouterr().out  # what the ranks printed, echoed by spawn
    assert out.count("epoch 1 done (naive print)") == 2
    assert out.count("epoch 1 done (rank_print)") == 1


@pytest.mark.timeout(150)
@pytest.mark.multiprocess
def test_evaluation_on_rank_zero_only_times_out_with_one_line():
    finding = pitfalls.check_rank0_only_evaluation(world_size=2, timeout_s=2.0)
    assert finding.shown
    _one_line(finding)
    assert finding.details["error"] == "Timed out waiting 2000ms for recv operation to complete"
    assert finding.details["waited_s"] >= 1.9  # it really waited for partners
    # The fix in the same job: every rank evaluates, and all 50 samples are counted.
    assert finding.details["total"] == 50


@pytest.mark.timeout(200)
@pytest.mark.multiprocess
def test_evaluate_counts_each_sample_once_on_one_two_and_three_ranks():
    size = 11
    finding = pitfalls_data.check_evaluation_count(world_sizes=(1, 2, 3), dataset_size=size)
    assert finding.shown
    _one_line(finding)
    counts = finding.details["counts"]
    # The same model and data evaluated in one plain loop, as ground truth.
    torch.manual_seed(0)
    model = ToyModel()
    features, labels = pitfalls.toy_eval_set(size).tensors
    with torch.no_grad():
        correct = int((model(features).argmax(1) == labels).sum())
    for world_size in (1, 2, 3):
        assert counts[world_size]["total"] == size
        assert counts[world_size]["correct"] == correct
    # DistributedSampler pads 11 samples to 12 on 2 and on 3 ranks.
    assert [counts[w]["padded_total"] for w in (1, 2, 3)] == [11, 12, 12]


@pytest.mark.multiprocess
def test_ranks_seeded_differently_get_rank_zeros_weights_from_ddp():
    finding = pitfalls_data.check_ddp_broadcast(world_size=2)
    assert finding.details == {"differed_before": True, "equal_after": True}
    assert finding.shown and "\n" not in str(finding)
