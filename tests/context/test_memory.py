"""Live-bytes counting is exact, and ring attention's peak per rank falls with the ranks."""

from __future__ import annotations

import pytest
import torch

from ddpguide.context.memory import LiveBytes, full_attention_peak, sweep


def test_live_bytes_counts_what_is_created_and_forgets_what_is_freed():
    a = torch.ones(1000, dtype=torch.float64)  # made before: not counted
    with LiveBytes() as counter:
        b = a * 2
        view = b[:10]  # a view of b: no new storage
        c = torch.zeros(500, dtype=torch.float32)
        assert counter.live == 8000 + 2000
        del b, view
        assert counter.live == 2000
        del c
    assert (counter.live, counter.peak) == (0, 10000)


def test_full_attention_holds_the_scores():
    seq = 256
    scores = 1 * 2 * seq * seq * 8  # batch 1, 2 heads, float64
    assert full_attention_peak(seq) >= 2 * scores


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ring_peak_per_rank_falls_with_the_ranks():
    seqs = (128, 256)
    peaks = sweep(seqs, worlds=(2,))
    assert set(peaks) == {1, 2}
    for one, two in zip(peaks[1], peaks[2]):
        assert two < 0.5 * one


def test_a_length_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="sequence length 130 does not split over 4 ranks"):
        sweep((130,), worlds=(4,))
