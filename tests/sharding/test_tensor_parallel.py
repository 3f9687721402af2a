"""Tensor parallelism: MLP, attention and sequence parallelism equal one process; plan typos fail.

One 2-rank start runs every case (a start costs seconds); the tests read its results.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ddpguide.launch import programs
from ddpguide.sharding import tensor_parallel as tp
from tests.edited_programs import edited_copy

# The chapter's program: its modules and plans are what the checks run.
PROGRAM = programs.load(tp.PROGRAM)


#: The program with one plan changed, as a reader might: ``up`` all-gathers its output, ``down``
#: stays whole. The check must follow the program.
EDIT = ('{"up": ColwiseParallel(), "down": RowwiseParallel()}',
        '{"up": ColwiseParallel(output_layouts=Replicate())}')


def _edited_program() -> str:
    return str(edited_copy(tp.PROGRAM, tempfile.mkdtemp(prefix="edited-program-"), EDIT, (
        "from torch.distributed.tensor.placement_types import Shard",
        "from torch.distributed.tensor.placement_types import Replicate, Shard")))


def _calls(world: int) -> dict[str, tuple]:
    return {"cases": (tp.compare_all,), "typo": (tp.typo_in_plan, "dwn"),
            "edited": (tp.compare_with_one_process, "mlp", 0, _edited_program())}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(tp.cases()))
def test_parallel_equals_one_process_float64(spawned, case):
    for rank, result in enumerate(spawned(2)):
        report = result["cases"][case]
        assert report["world"] == 2
        # output, input gradient and every parameter gradient, worst over both ranks
        assert report["max_difference"] <= tp.TOLERANCE, (rank, report["max_difference"])


@pytest.mark.timeout(300)
def test_megatron_placements_and_collectives(spawned):
    mlp = spawned(2)[0]["cases"]["mlp"]
    params = {row["tensor"]: row for row in mlp["parameters"]}
    assert params["up.weight"]["placements"] == "(Shard(dim=0),)"       # column-parallel
    assert params["up.weight"]["local shape"] == (PROGRAM.HIDDEN // 2, PROGRAM.DIM)
    assert params["down.weight"]["placements"] == "(Shard(dim=1),)"     # row-parallel
    assert params["down.weight"]["local shape"] == (PROGRAM.DIM, PROGRAM.HIDDEN // 2)
    assert params["down.bias"]["placements"] == "(Replicate(),)"
    acts = {row["module"]: row for row in mlp["activations"]}
    assert acts["up"]["input"] == "(Replicate(),)" and acts["up"]["computes"] == "(Shard(dim=2),)"
    assert acts["down"]["computes"] == "(Partial(sum),)"                 # summands ...
    assert acts["down"]["hands on"] == "(Replicate(),)"                  # ... all-reduced
    assert mlp["forward_comms"] == {"all_reduce": 1}
    assert mlp["backward_comms"] == {"all_reduce": 1}                    # the input's gradient


@pytest.mark.timeout(300)
def test_a_plan_changed_in_the_program_changes_the_check(spawned):
    edited = spawned(2)[0]["edited"]
    params = {row["tensor"]: row for row in edited["parameters"]}
    assert params["down.weight"]["placements"] == "plain tensor"        # no longer split
    assert params["down.weight"]["local shape"] == (PROGRAM.DIM, PROGRAM.HIDDEN)
    assert edited["forward_comms"] == {"all_gather": 1}                 # up gathers its output
    assert edited["max_difference"] <= tp.TOLERANCE                    # and it is still correct


@pytest.mark.timeout(300)
def test_attention_splits_heads_and_sequence_parallel_collectives(spawned):
    cases = spawned(2)[0]["cases"]
    attention = {row["tensor"]: row for row in cases["attention"]["parameters"]}
    for name in ("q", "k", "v"):
        assert attention[f"{name}.weight"]["local shape"] == (PROGRAM.DIM // 2, PROGRAM.DIM)  # 2 of 4 heads
    assert attention["out.weight"]["placements"] == "(Shard(dim=1),)"
    assert cases["attention"]["forward_comms"] == {"all_reduce": 1}
    assert cases["attention"]["backward_comms"] == {"all_reduce": 3}     # one per q, k, v input
    sp = cases["sequence_parallel"]
    assert sp["forward_comms"] == {"all_gather": 1, "reduce_scatter": 1}
    assert sp["backward_comms"] == {"all_gather": 1, "reduce_scatter": 1}
    norm = {row["tensor"]: row for row in sp["parameters"]}["norm.weight"]
    assert (norm["placements"], norm["gradient"]) == ("(Replicate(),)", "(Partial(sum),)")


@pytest.mark.timeout(300)
def test_parallelize_module_only_warns_about_a_typo_and_ours_refuses(spawned):
    typo = spawned(2)[0]["typo"]
    assert len(typo["parallelize_module"]) == 1 and "'dwn'" in typo["parallelize_module"][0]
    assert typo["down_is_plain"] is True      # the layer silently stayed whole
    assert typo["ours"] == ("ValueError: tensor-parallel plan entry 'dwn' names no submodule of "
                            "MLP (its submodules: up, down)")


def test_check_plan_message_and_nothing_changed():
    model = PROGRAM.Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        # the mesh is never used: the plan is checked first
        tp.parallelize(model, None, {"norm": ColwiseParallel(), "mlp.upp": ColwiseParallel()})
    assert str(info.value) == ("tensor-parallel plan entry 'mlp.upp' names no submodule of Block "
                               "(its submodules: norm, mlp, mlp.up, mlp.down)")
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_check_plan_accepts_what_parallelize_module_matches():
    model = torch.nn.Sequential(PROGRAM.MLP(), PROGRAM.MLP())
    tp.check_plan(model, {"*.up": ColwiseParallel(), "1.down": RowwiseParallel(), "": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"entry '\*\.middle' names no submodule of Sequential"):
        tp.check_plan(model, {"*.middle": ColwiseParallel()})
    with pytest.raises(ValueError, match="entry '2.up'"):
        tp.check_plan(model, {"2.up": ColwiseParallel()})
