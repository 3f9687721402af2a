"""2-D meshes: FSDP2 x TP and HSDP equal one process over SGD steps; bad mesh shapes fail first.

The 4-rank start is the slow part (4 processes on 2 cores): both layouts run in one.
"""

from __future__ import annotations

import pytest

from ddpguide.launch import programs
from ddpguide.sharding import mesh2d
from ddpguide.sharding.tensor_parallel import TOLERANCE

PROGRAM = programs.load(mesh2d.PROGRAM)  # the chapter's program: its model is what is checked


def _calls(world: int) -> dict[str, tuple]:
    return {"fsdp_tp": (mesh2d.fsdp_tp,), "hsdp": (mesh2d.hsdp,)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp"])
def test_2d_training_equals_one_process(spawned, layout):
    results = spawned(4)
    for rank, result in enumerate(results):
        report = result[layout]
        assert report["mesh"] == [[0, 1], [2, 3]]
        assert report["coordinate"] == (rank // 2, rank % 2)
        # losses of all 3 steps and every weight afterwards, worst over the 4 ranks
        assert report["max_difference"] <= TOLERANCE, (rank, report["max_difference"])
        assert len(report["losses"]) == PROGRAM.STEPS == 3
        assert report["losses"][-1] < report["losses"][0]  # it trained


@pytest.mark.timeout(400)
def test_2d_placements(spawned):
    fsdp_tp = {r["parameter"]: r for r in spawned(4)[0]["fsdp_tp"]["parameters"]}
    # TP splits dim 0 of `up` over "tp", FSDP splits the piece again over "dp"
    assert fsdp_tp["layers.0.up.weight"]["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert fsdp_tp["layers.0.up.weight"]["local shape"] == (PROGRAM.HIDDEN // 4, PROGRAM.DIM)
    assert fsdp_tp["layers.0.down.weight"]["placements"] == "(Shard(dim=0), Shard(dim=1))"
    assert fsdp_tp["layers.0.down.bias"]["placements"] == "(Shard(dim=0), Replicate())"
    # rank (dp i, tp j) holds rows 16 j + 8 i ... + 8: TP cut first, FSDP cut TP's piece
    held = [r["fsdp_tp"]["rows_held"] for r in spawned(4)]
    assert held == [("layers.0.up.weight", a, a + 8) for a in (0, 16, 8, 24)]
    assert [r["hsdp"]["rows_held"][1] for r in spawned(4)] == [0, 16, 0, 16]
    hsdp = {r["parameter"]: r for r in spawned(4)[0]["hsdp"]["parameters"]}
    assert {r["placements"] for r in hsdp.values()} == {"(Replicate(), Shard(dim=0))"}
    assert hsdp["layers.0.up.weight"]["local shape"] == (PROGRAM.HIDDEN // 2, PROGRAM.DIM)


@pytest.mark.parametrize("shape, world, message", [
    ((2, 3), 4, "mesh shape (2, 3) holds 6 ranks, but the world size is 4"),
    ((2, 2), 2, "mesh shape (2, 2) holds 4 ranks, but the world size is 2"),
    ((0, 4), 4, "mesh shape (0, 4) needs at least one dimension, all of size >= 1"),
    ((), 1, "mesh shape () needs at least one dimension, all of size >= 1"),
])
def test_mesh_shape_must_multiply_to_the_world(shape, world, message):
    with pytest.raises(ValueError) as info:
        mesh2d.check_mesh_shape(shape, world)
    assert str(info.value) == message


def test_mesh_2d_checks_before_creating_groups(monkeypatch):
    monkeypatch.setattr(mesh2d.dist, "get_world_size", lambda: 4)

    def no_groups(*args, **kwargs):
        raise AssertionError("a process group was requested")

    monkeypatch.setattr(mesh2d, "device_mesh", no_groups)
    with pytest.raises(ValueError, match=r"^mesh shape \(4, 2\) holds 8 ranks, but the world size is 4$"):
        mesh2d.mesh_2d((4, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"^mesh names \('dp',\) do not match mesh shape \(2, 2\)$"):
        mesh2d.mesh_2d((2, 2), ("dp",))
    assert mesh2d.check_mesh_shape([2, 2], 4) == (2, 2)
