"""Point-to-point pipelining by hand: an activation arrives with its shape, whatever it is."""

from __future__ import annotations

import pytest
import torch

from ddpguide.launch.spawn import spawn
from ddpguide.pipeline.p2p import send_activation
from tests.pipeline.pipeline_workers import P2P_CASES, exchange_activations, p2p_activation


@pytest.mark.timeout(150)
def test_activations_of_every_shape_and_dtype_arrive_intact_both_ways():
    to_rank0, to_rank1 = spawn(exchange_activations, 2, P2P_CASES, backend="gloo", timeout=120,
                               collective_timeout=60, echo=False)
    assert len(to_rank1) == len(to_rank0) == len(P2P_CASES)
    for index, (shape, dtype, transposed) in enumerate(P2P_CASES):
        sent = p2p_activation(index, shape, dtype, transposed)
        for received, expected in ((to_rank1[index], sent), (to_rank0[index], sent * 2)):
            assert received.dtype == dtype and received.shape == torch.Size(shape), index
            assert received.is_contiguous()
            assert torch.equal(received, expected), index


def test_too_many_dimensions_are_refused_before_anything_is_sent():
    """The header holds 7 sizes; an 8-dimensional tensor fails on the sender at once
    (no process group is needed to find out), instead of leaving the receiver waiting."""
    with pytest.raises(ValueError) as info:
        send_activation(torch.zeros((1,) * 8), dst=1)
    assert str(info.value) == "send_activation sends at most 7 dimensions, got a tensor of 8"
