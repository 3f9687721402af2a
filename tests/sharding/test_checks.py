"""ZeRO-1, ZeRO-2/3 by hand and FSDP2 train exactly like one process on the full batch."""

from __future__ import annotations

import pytest
import torch

from ddpguide.launch.spawn import spawn
from ddpguide.sharding import checks
from tests.edited_programs import edited_copy

TOLERANCE = 1e-12
_CACHE: dict[int, list[dict]] = {}


def results(world: int) -> list[dict]:
    """Every rank's parts, one spawn per world size for the whole module."""
    if world not in _CACHE:
        parts = ["equivalence", "collectives", "refusals", "program", "peak", "order"] if world == 2 \
            else ["equivalence"]
        _CACHE[world] = spawn(checks.run_parts, world, parts, timeout=300, echo=False)
    return _CACHE[world]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", checks.SHARDED)
def test_equal_to_one_process_in_float64(world, strategy):
    for rank, r in enumerate(results(world)):
        diff = r["equivalence"]["max_diff"][strategy]
        assert diff <= TOLERANCE, (world, rank, strategy, diff)


@pytest.mark.parametrize("world", [2, 3])
def test_hand_written_zero3_equals_fully_shard(world):
    for r in results(world):
        assert r["equivalence"]["max_diff"]["zero3_hand vs fsdp2"] <= TOLERANCE


def test_uneven_shards_over_three_ranks():
    # Linear(6, 10): 10 rows over 3 ranks follow torch.chunk (4, 4, 2); flat shards pad to 3 x 20
    fsdp = [r["equivalence"]["local_shapes"]["fsdp2"] for r in results(3)]
    assert [s["0.weight"] for s in fsdp] == [(4, 6), (4, 6), (2, 6)]
    assert [s["2.weight"] for s in fsdp] == [(2, 10), (2, 10), (1, 10)]
    hand = [r["equivalence"]["local_shapes"]["zero3_hand"] for r in results(3)]
    assert all(s["0.bias"] == (4,) and s["2.weight"] == (17,) and s["4.bias"] == (1,) for s in hand)
    assert all(r["equivalence"]["local_shapes"]["ddp"]["0.weight"] == (10, 6) for r in results(3))


def test_collectives_of_one_step():
    counts = results(2)[0]["collectives"]
    layers, tensors = 3, 6
    assert counts["ddp"] == {"forward": {}, "backward": {"allreduce_": 1}, "optimizer.step": {}}
    assert counts["zero1"]["optimizer.step"] == {"broadcast_": tensors}
    assert counts["fsdp2"] == {"forward": {"_allgather_base_": layers},
                               "backward": {"_allgather_base_": layers, "_reduce_scatter_base_": layers},
                               "optimizer.step": {}}
    assert counts["fsdp2 (keep)"]["backward"] == {"_reduce_scatter_base_": layers}
    assert counts["zero3_hand"]["backward"] == {"_allgather_base_": tensors,
                                                "_reduce_scatter_base_": tensors}
    assert counts["zero2_hand"]["backward"] == {"_reduce_scatter_base_": tensors}


def test_fsdp2_gathers_the_previous_layer_before_each_backward():
    for r in results(2):
        assert " ".join(r["order"]["backward"]) == "B3 AG AG mm mm RS B2 AG mm mm RS B1 AG mm mm RS B0 mm RS"
        assert " ".join(r["order"]["forward"]) == "AG F0 mm AG F1 mm AG F2 mm AG F3 mm"


def test_the_peak_inside_a_step_by_kind():
    """torch's MemTracker on one step of each strategy, 4 x Linear(64, 64) in float32 on 2 ranks."""
    for r in results(2):
        peaks = {p["strategy"]: p for p in r["peak"]}
        layer, model = 64 * 65 * 4, 4 * 64 * 65 * 4
        fsdp = peaks["fsdp2"]["kinds"]
        assert fsdp["Unsharded Param"] == layer and fsdp["Sharded Param"] == model // 2
        assert fsdp["All Gather"] == layer  # one unit's buffer at a time
        assert peaks["ddp"]["ddp_buckets"] == model and peaks["fsdp2"]["ddp_buckets"] == 0
        assert peaks["ddp"]["kinds"]["Parameter"] == peaks["zero2_hand"]["kinds"]["Parameter"] == model
        for p in peaks.values():
            assert p["kinds"]["Total"] + p["ddp_buckets"] > p["between_steps"], p
        ddp = peaks["ddp"]["kinds"]["Total"] + model
        assert all(peaks[n]["kinds"]["Total"] < ddp for n in ("zero2_hand", "zero3_hand", "fsdp2"))


def test_refusals_name_the_problem():
    errors = results(2)[0]["refusals"]
    assert errors["shared parameter"] == (
        "ShardingError", "parameter 'b.weight' is the same tensor as 'a.weight': shared "
        "parameters cannot be sharded module by module")
    assert errors["no parameters"] == ("ShardingError", "the model (Sequential) has no parameters to shard")
    assert errors["unknown strategy"] == (
        "ValueError", "unknown strategy 'zero4': choose one of single, ddp, zero1, zero2_hand, "
        "zero3_hand, fsdp2")


def test_sharding_needs_a_process_group():
    from ddpguide.sharding.zero3 import ShardedModel, ShardingError

    with pytest.raises(ShardingError, match="^ZeRO-3 needs a process group: call "
                                            "dist.init_process_group first$"):
        ShardedModel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("world, message", [
    (0, "world size must be a positive integer, got 0"),
    (-1, "world size must be a positive integer, got -1"),
    (5, "world size 5 does not divide the batch of 12 samples"),
])
def test_check_equivalence_refuses_bad_world_sizes_before_starting(world, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        checks.check_equivalence(world_sizes=(2, world))


def test_unknown_part_is_refused():
    with pytest.raises(ValueError, match="^unknown part 'speed'; choose from collectives, "
                                         "equivalence, memory, order, peak, program, refusals$"):
        checks.check_parts(["memory", "speed"])


@pytest.mark.multiprocess
def test_check_equivalence_reports_and_asserts():
    rows = checks.check_equivalence(world_sizes=(2,), strategies=("zero3_hand", "fsdp2"))
    assert [r["compared"] for r in rows] == ["zero3_hand", "fsdp2", "zero3_hand vs fsdp2"]
    assert all(r["within tolerance"] and r["largest difference"] <= TOLERANCE for r in rows)
    with pytest.raises(AssertionError, match="differences above 1e-30"):
        checks.check_equivalence(world_sizes=(2,), strategies=("ddp",), tolerance=1e-30)


#: The program as a reader might turn it into ZeRO-2: the full parameters stay from forward
#: to backward (not freed after forward, not gathered again for backward).
ZERO2_EDIT = (("        def after_forward(layer, args, output, own=own):\n"
               "            for s in own:\n                s.free()\n",
               "        def after_forward(layer, args, output, own=own):\n"),
              ("                output.register_hook(gather_for_backward)", "                pass"))


def test_the_programs_own_zero3_makes_the_collectives_the_chapter_counts():
    """Counted on zero3_by_hand.py itself: one all-gather per tensor in forward and again in
    backward, one reduce-scatter per tensor; the package's zero3_hand makes the same."""
    results2 = results(2)
    tensors = 6
    for r in results2:
        assert r["program"] == {"forward": {"_allgather_base_": tensors},
                                "backward": {"_allgather_base_": tensors,
                                             "_reduce_scatter_base_": tensors},
                                "optimizer.step": {}}
    assert results2[0]["program"] == results2[0]["collectives"]["zero3_hand"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_program_count_follows_the_program(tmp_path):
    edited = edited_copy(checks.PROGRAM, tmp_path, *ZERO2_EDIT)
    counts = spawn(checks.program_collectives, 2, str(edited), timeout=240, echo=False)[0]
    assert counts["forward"] == {"_allgather_base_": 6}
    assert counts["backward"] == {"_reduce_scatter_base_": 6}  # no second all-gather
