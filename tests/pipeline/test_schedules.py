"""Library schedules: a batch that does not split evenly fails on every rank at once."""

from __future__ import annotations

import pytest

from ddpguide.launch.spawn import spawn
from ddpguide.pipeline.schedules import check_equal_microbatches
from tests.pipeline.pipeline_workers import build_schedules

COLLECTIVE_TIMEOUT_S = 60


def test_the_micro_batch_rule():
    for batch, split in ((8, 2), (8, 8), (8, 16), (120, 20)):
        check_equal_microbatches(batch, split)  # equal micro-batches, or one batch
    with pytest.raises(ValueError) as info:
        check_equal_microbatches(8, 3)
    assert str(info.value) == ("torch.distributed.pipelining needs equal micro-batches: "
                               "split_size 3 does not divide the batch of 8 (the hand-written "
                               "GPipe accepts it)")


@pytest.mark.timeout(120)
def test_a_non_dividing_split_size_raises_on_every_rank_without_waiting():
    """Both ranks raise ValueError within a moment, long before the collective timeout
    (a rank that went ahead would wait up to 60 s for its partner); a good split
    size right after builds on both ranks, so the group is still usable."""
    results = spawn(build_schedules, 2, 8, [3, 2], backend="gloo", timeout=100,
                    collective_timeout=COLLECTIVE_TIMEOUT_S, echo=False)
    message = ("torch.distributed.pipelining needs equal micro-batches: split_size 3 does not "
               "divide the batch of 8 (the hand-written GPipe accepts it)")
    for rank, (bad, good) in enumerate(results):
        assert (bad["rank"], bad["split_size"], bad["error"], bad["built"]) == (rank, 3, message, None)
        assert bad["seconds"] < 5.0, bad  # measured on the rank: no waiting for its partner
        assert (good["error"], good["built"]) == (None, (rank == 0, rank == 1))
