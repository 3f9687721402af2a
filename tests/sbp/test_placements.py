"""SBP vocabulary on DTensor: names, who-holds-what, 2D SBP, training as SBP, mistakes.

The multi-process checks share one 4-rank spawn (module fixture): starting
ranks costs more than all the checks together.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ddpguide.launch import programs
from ddpguide.launch.spawn import spawn
from ddpguide.sbp import examples, regions
from ddpguide.sbp import placements as sbp
from ddpguide.sbp.placements import B, P, S, SBPError
from ddpguide.sbp.workers import run
from tests.edited_programs import edited_copy

# The source's samples, from the program the chapter shows (book/programs/dtensor_regression.py).
SEED_X, SEED_Y = programs.load(examples.PROGRAM).SEED_X, programs.load(examples.PROGRAM).SEED_Y

WORLD = 4
PARTS = ["sbp_1d", "regions_2d", "seed_2d", "signature_2d", "linear_regression",
         "tensor_parallel", "invalid_inputs"]


@pytest.fixture(scope="module")
def ranks():
    return spawn(run, WORLD, PARTS, timeout=200, collective_timeout=60, echo=False)


# ---------------------------------------------------------------- pure vocabulary

def test_names_map_onto_dtensor_placements():
    assert B == Replicate() and S(1) == Shard(1) and P == Partial("sum")
    assert sbp.broadcast == B and sbp.split(0) == Shard(0) and sbp.partial_sum == P
    assert [sbp.sbp_name(p) for p in (B, S(1), P, Partial("max"))] == ["B", "S(1)", "P", "P(max)"]
    assert sbp.sbp_names((B, S(0))) == "(B, S(0))"
    for text, expected in [("B", B), ("broadcast", B), ("split(1)", S(1)), ("S(0)", S(0)),
                           ("P", P), ("partial", P), ("P(max)", Partial("max"))]:
        assert sbp.parse_sbp(text) == expected
    with pytest.raises(SBPError, match=r"unknown SBP 'Q\(1\)': use B, S\(dim\) or P"):
        sbp.parse_sbp("Q(1)")


def test_sbp_count_and_missing_dimension_are_explained():
    with pytest.raises(SBPError, match=r"^a 2D placement needs 2 SBP entries \(one per mesh "
                                       r"dimension\), got 1: B$"):
        sbp.as_placements(B, 2)
    with pytest.raises(SBPError, match=r"^S\(2\) splits tensor dimension 2, but the tensor has "
                                       r"shape \(5, 4\) \(2 dimensions\)$"):
        sbp.check_sbp((5, 4), (S(2),))
    assert sbp.check_sbp((5, 4), (S(-1), B)) == (S(1), B)


def test_placement_needs_a_running_job():
    with pytest.raises(SBPError, match="no process group: run inside ddpguide.launch.spawn"):
        sbp.placement([[0, 1], [2, 3]])


@pytest.mark.parametrize("size", [0, 1, 3, 5, 6, 7, 8, 13])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_bounds_follow_torch_chunk(size, parts):
    chunks = torch.arange(size).chunk(parts) if size else ()
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
    ours = [regions.chunk_bounds(size, parts, i) for i in range(parts)]
    assert [b for b in ours if b[1] > b[0]] == expected
    # Missing chunks are empty and sit at the end, as DTensor fills them.
    assert all(stop - start == 0 for start, stop in ours[len(expected):])


def test_six_rows_over_four_ranks_is_not_balanced():
    sizes = [stop - start for start, stop in (regions.chunk_bounds(6, 4, i) for i in range(4))]
    assert sizes == [2, 2, 2, 0]


def test_seed_figure_broadcast_split0_on_2x2():
    pieces = regions.local_regions((4, 2), (2, 2), (B, S(0)))
    assert pieces[(0, 0)].bounds == pieces[(1, 0)].bounds == ((0, 2), (0, 2))
    assert pieces[(0, 1)].bounds == pieces[(1, 1)].bounds == ((2, 4), (0, 2))
    assert not any(r.partial for r in pieces.values())
    nested = regions.local_regions((5, 3), (2, 2), (S(0), S(0)))
    assert [nested[c].shape for c in regions.mesh_coordinates((2, 2))] == [(2, 3), (1, 3), (1, 3), (1, 3)]


def test_layout_figure_has_one_panel_per_rank():
    from ddpguide.sbp.viz import draw_layout, explorer

    fig = draw_layout((4, 6), (2, 2), ("B", "S(0)"))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["rank 0 (0, 0)\nlocal (2, 6)", "rank 1 (0, 1)\nlocal (2, 6)",
                      "rank 2 (1, 0)\nlocal (2, 6)", "rank 3 (1, 1)\nlocal (2, 6)"]
    fig = draw_layout((5, 3), (4,), ("S(0)",))
    assert [ax.get_title().split("\n")[1] for ax in fig.axes] == \
        ["local (2, 3)", "local (2, 3)", "local (1, 3)", "local (0, 3)"]
    with pytest.raises(ValueError, match=r"draw_layout shows 2D tensors, got shape \(2, 2, 8\)"):
        draw_layout((2, 2, 8), (2, 2), ("B", "S(0)"))
    fig = draw_layout((2, 2), (2, 2), ("B", "S(0)"), values=[[1, 2], [3, 4]])
    assert [t.get_text() for t in fig.axes[1].texts] == ["3", "4"]
    panel = explorer()
    controls, image = panel.children
    mesh, row_box, dim_box = controls.children
    (rows, cols), (dim0, dim1) = row_box.children, dim_box.children
    assert (mesh.value, rows.value, cols.value, dim0.value, dim1.value) == ("2D: 2 x 2", 4, 6, "B", "S(0)")
    assert bytes(image.value).startswith(b"\x89PNG") and not dim1.disabled
    first = bytes(image.value)
    mesh.value = "1D: 4 ranks"  # the second mesh dimension's placement no longer applies
    assert dim1.disabled and bytes(image.value).startswith(b"\x89PNG") and bytes(image.value) != first
    rows.value = 9 - 1
    assert panel.children == (controls, image) and bytes(image.value).startswith(b"\x89PNG")


# ---------------------------------------------------------------- on 4 ranks

@pytest.mark.timeout(240)
def test_1d_pieces_match_local_regions(ranks):
    logical = ranks[0]["sbp_1d"]["logical"]
    for rank, result in enumerate(ranks):
        pieces = result["sbp_1d"]["locals"]
        for name in ("B", "S(0)", "S(1)"):
            region = regions.local_regions(logical.shape, (WORLD,), name)[(rank,)]
            assert torch.equal(pieces[name], logical[region.slices]), (rank, name)
        assert [result["sbp_1d"]["uneven"][rows].shape[0] for rows in (5, 6)] == \
            [[2, 2, 1, 0][rank], [2, 2, 2, 0][rank]]
    assert torch.equal(sum(r["sbp_1d"]["locals"]["P"] for r in ranks), logical)


@pytest.mark.timeout(240)
def test_2d_pieces_match_local_regions(ranks):
    logical = ranks[0]["regions_2d"]["logical"]
    for result in ranks:
        coord = result["regions_2d"]["coord"]
        for name, piece in result["regions_2d"]["pieces"].items():
            placements = sbp.as_placements([x.strip() for x in name[1:-1].split(", ")], 2)
            region = regions.local_regions(logical.shape, (2, 2), placements)[coord]
            scale = 2 ** sum(isinstance(p, Partial) for p in placements)  # R -> P divides by n
            assert torch.equal(piece * scale, logical[region.slices]), (coord, name)


@pytest.mark.timeout(240)
def test_seed_2d_example(ranks):
    a = [r["seed_2d"]["a_local"].tolist() for r in ranks]
    assert a == [[[1.0, 2.0]], [[3.0, 4.0]], [[1.0, 2.0]], [[3.0, 4.0]]]
    x = [r["seed_2d"]["x_local"] for r in ranks]
    assert all(t.shape == (1, 2, 8) for t in x)
    assert torch.equal(x[0], x[2]) and torch.equal(x[1], x[3]) and not torch.equal(x[0], x[1])
    for r in ranks:
        assert r["seed_2d"]["pred_sbp"] == "(B, S(0))"
        assert r["seed_2d"]["forward_comms"] == {}
        torch.testing.assert_close(r["seed_2d"]["pred"], r["seed_2d"]["expected"])


@pytest.mark.timeout(240)
def test_matmul_signatures_from_sharding_propagation(ranks):
    cases = {(c["x"], c["w"]): c for c in ranks[0]["signature_2d"]}
    assert {k: c["y"] for k, c in cases.items()} == {
        ("B", "S(1)"): "S(1)", ("S(0)", "B"): "S(0)", ("S(1)", "S(0)"): "P",
        ("(B, S(0))", "(S(1), B)"): "(S(1), S(0))",
    }
    for c in cases.values():
        assert c["comms"] == {}  # a signature needs no boxing
        torch.testing.assert_close(c["y_full"], c["expected"], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(240)
def test_data_parallel_regression_reaches_2_3(ranks):
    x, y = torch.tensor(SEED_X), torch.tensor(SEED_Y)
    full_grad_at_zero = -2 * x.T @ y
    assert torch.equal(sum(r["linear_regression"]["grad_local"] for r in ranks), full_grad_at_zero)
    for r in ranks:
        lr = r["linear_regression"]
        assert (lr["w"].flatten() - torch.tensor([2.0, 3.0])).abs().max() <= 1e-3
        torch.testing.assert_close(lr["w"], lr["w_ref"], rtol=1e-5, atol=1e-5)
        assert torch.equal(lr["w_local"], lr["w"])
        assert (lr["w_sbp"], lr["pred_sbp"], lr["loss_sbp"], lr["grad_sbp"]) == ("B", "S(0)", "P", "P")
        # Each rank's partial gradient is its own shard's gradient, as in DDP before the all-reduce.
        assert torch.equal(lr["grad_local"], lr["own_shard_grad"])
        assert lr["forward_backward_comms"] == {} and lr["step_comms"] == {"all_reduce": 1}


@pytest.mark.timeout(240)
def test_tensor_parallel_mlp_equals_plain_mlp(ranks):
    for r in ranks:
        tp = r["tensor_parallel"]
        torch.testing.assert_close(tp["out"], tp["expected"], rtol=1e-5, atol=1e-6)
        for name, grad in tp["grads"].items():
            torch.testing.assert_close(grad, tp["expected_grads"][name], rtol=1e-5, atol=1e-6)
        assert tp["param_sbp"] == {"0.weight": "S(0)", "0.bias": "S(0)", "2.weight": "S(1)", "2.bias": "B"}
        assert tp["local_shapes"]["0.weight"] == (16 // WORLD, 8)
        assert tp["forward_comms"] == {"all_reduce": 1}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_tensor_parallel_check_follows_the_program(tmp_path):
    """An edited copy of the program with a hidden layer of 32: the check runs the edit."""
    layer = "nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))"
    wider = "nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))"
    # twice: the plain module and the one it parallelizes
    edited = edited_copy(examples.PROGRAM, tmp_path, (layer, wider), count=2)
    results = spawn(run, 2, ["tensor_parallel"], {"tensor_parallel": {"program": str(edited)}},
                    timeout=200, collective_timeout=60, echo=False)
    for r in results:
        tp = r["tensor_parallel"]
        assert tp["local_shapes"]["0.weight"] == (32 // 2, 8)
        assert tp["local_shapes"]["2.weight"] == (8, 32 // 2)
        torch.testing.assert_close(tp["out"], tp["expected"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_invalid_placements_give_clear_errors(ranks):
    errors = ranks[0]["invalid_inputs"]
    assert errors["split_missing_dim"] == (
        "SBPError", "S(2) splits tensor dimension 2, but the tensor has shape (5, 4) (2 dimensions)")
    # DTensor's own message names neither the placement nor the tensor.
    assert errors["split_missing_dim_dtensor"] == (
        "IndexError", "Dimension out of range (expected to be in range of [-2, 1], but got 2)")
    assert errors["mesh_too_big"] == (
        "SBPError", "mesh (2, 4) needs 8 ranks but the world has only 4 (WORLD_SIZE=4)")
    assert errors["mesh_too_big_dtensor"] == (
        "RuntimeError", "Mesh should not be bigger than default world size 4, but found 8 ranks!")
    assert errors["placement_outside"] == (
        "SBPError", "placement ranks [0, 1, 2, 3, 4, 5] include rank 4, but the world has only "
        "4 ranks (0-3)")
    assert errors["sbp_count"] == (
        "SBPError", "a 1D placement needs 1 SBP entry (one per mesh dimension), got 2: (B, S(0))")
    assert errors["partial_kind"] == (
        "BoxingError", "P -> P(max) would change the pending reduction; reduce first (P -> B), "
        "then B -> P(max)")
    assert errors["partial_kind_dtensor"][0] == "RuntimeError"
    assert "Can not redistribute from P(sum) to P(max)" in errors["partial_kind_dtensor"][1]
