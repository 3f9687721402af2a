"""fsdp2_recipes.py's initial-weights check reads the rows fully_shard leaves each rank, on any
number of ranks: fully_shard splits dimension 0 as torch.chunk does (FSDP2's
_chunk_with_empty), so 12 rows on 5 ranks are 3, 3, 3, 3 and 0, not 12 // 5 = 2 each."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from ddpguide.launch.programs import load


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 12, 13])
def test_the_rows_of_each_rank_are_fully_shard_s(world):
    program = load("fsdp2_recipes.py")
    rows = torch.arange(program.VOCAB)
    for rank, chunk in enumerate(_chunk_with_empty(rows, world, dim=0)):
        assert torch.equal(rows[program.my_rows(rank, world)], chunk), (rank, world)
