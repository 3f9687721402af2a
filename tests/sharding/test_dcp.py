"""Sharded checkpoints: exact reshards (2 -> 3, 4 -> 2), the "another model" check, bad
targets, and atomic saves under SIGKILL.

The round trips start three worlds once for the module: 4 ranks save (FSDP x TP on a
2x2 mesh), 2 ranks load that and save their own, 3 ranks load the 2-rank checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch

from ddpguide.launch.spawn import run_several, spawn
from ddpguide.sharding import dcp as sharded
from ddpguide.sharding import dcp_kill
from ddpguide.sharding import dcp_workers as W


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    four, two, tp = str(root / "four"), str(root / "two"), str(root / "tp")
    runs = {"root": root}
    runs[4] = spawn(run_several, 4, {"save": (W.train_and_save, four, "fsdp_tp")},
                    timeout=300, echo=False)
    runs[2] = spawn(run_several, 2, {"load": (W.load_and_gather, four),
                                     "save": (W.train_and_save, two),
                                     "save_tp": (W.train_and_save, tp, "tp"),
                                     "other": (W.load_another_model, two)},
                    timeout=300, echo=False)
    runs[3] = spawn(run_several, 3, {"load": (W.load_and_gather, two)}, timeout=300, echo=False)
    return runs


def _exact(saved: dict, loaded: dict) -> None:
    report = W.compare(saved, loaded)
    assert report["missing"] == [] and report["different"] == []
    assert report["identical"] == report["compared"] == 32  # 8 weights + 8 x (step, exp_avg, exp_avg_sq)


@pytest.mark.timeout(600)
def test_every_saving_rank_holds_the_same_model(roundtrips):
    for world in (4, 2):
        saved = [r["save"]["tensors"] for r in roundtrips[world]]
        for other in saved[1:]:
            _exact(saved[0], other)


@pytest.mark.timeout(600)
def test_saved_by_2_loads_exactly_into_3(roundtrips):
    saved = roundtrips[2][0]["save"]["tensors"]
    for result in roundtrips[3]:
        _exact(saved, result["load"]["tensors"])
        assert W.compare(saved, result["load"]["before"])["identical"] == 0  # the load did it
        assert result["load"]["extra"] == {"step": 2, "saved_by": 2}
    assert [r["save"]["pieces"]["local shape"] for r in roundtrips[2]] == [(10, 8), (10, 8)]
    assert [r["load"]["pieces"]["local shape"] for r in roundtrips[3]] == [(7, 8), (7, 8), (6, 8)]


@pytest.mark.timeout(600)
def test_saved_by_4_on_a_2d_mesh_loads_exactly_into_2(roundtrips):
    saved = roundtrips[4][0]["save"]
    assert saved["pieces"] == {"placements": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                               "local shape": (5, 8)}
    assert saved["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                              "__3_0.distcp", "extra.pt"]
    for result in roundtrips[2]:
        _exact(saved["tensors"], result["load"]["tensors"])
        assert result["load"]["pieces"] == {"placements": "(Shard(dim=0),)", "local shape": (10, 8)}
        assert result["load"]["extra"] == {"step": 2, "saved_by": 4}
    # nothing but the checkpoints is left beside them: no .prev, no temporary directories
    assert sorted(os.listdir(roundtrips["root"])) == ["four", "tp", "two"]


@pytest.mark.timeout(600)
def test_saved_by_tensor_parallel_ranks_loads_exactly_into_one_plain_process(roundtrips):
    saved = roundtrips[2][0]["save_tp"]
    assert saved["pieces"] == {"placements": "(Shard(dim=0),)", "local shape": (10, 8)}
    _exact(saved["tensors"], roundtrips[2][1]["save_tp"]["tensors"])
    loaded = W.load_and_gather(str(roundtrips["root"] / "tp"), "plain")  # here, no process group
    _exact(saved["tensors"], loaded["tensors"])
    assert loaded["pieces"] == {"placements": "plain tensor", "local shape": (20, 8)}
    assert loaded["extra"] == {"step": 2, "saved_by": 2}


@pytest.mark.timeout(600)
def test_another_model_is_refused_by_every_rank_with_the_first_key(roundtrips):
    two = roundtrips["root"] / "two"
    for result in roundtrips[2]:
        assert result["other"]["error"] == (
            "CheckpointMismatch",
            f"checkpoint {two} was written for another model: 'layers.0.up.weight' has shape "
            "(20, 8) there but (24, 8) in this model")
        assert result["other"]["unchanged"] is True


# ---------------------------------------------------------------- one process, no spawn

def _tiny(out_features: int = 4, layers: int = 2):
    torch.manual_seed(out_features)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, out_features) for _ in range(layers)])
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_single_process_round_trip_and_extra(tmp_path):
    model, optimizer = _tiny()
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    sharded.save_sharded(model, optimizer, tmp_path / "ckpt", {"epoch": 7, "rng": torch.arange(3)})
    sharded.save_sharded(model, optimizer, tmp_path / "ckpt", {"epoch": 8})  # replaces it
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    other, other_optimizer = _tiny()
    other[0].weight.data.zero_()
    assert sharded.load_sharded(other, other_optimizer, tmp_path / "ckpt") == {"epoch": 8}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(other_optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)


@pytest.mark.parametrize("model_args, difference", [
    ((5, 2), "'0.weight' has shape (4, 4) there but (5, 4) in this model"),
    ((4, 1), "it has '1.weight', which this model lacks"),
    ((4, 3), "it has no '2.weight'"),
])
def test_check_fits_names_the_first_differing_key(tmp_path, model_args, difference):
    model, _ = _tiny()
    sharded.save_sharded(model, None, tmp_path / "ckpt")
    other, other_optimizer = _tiny(*model_args)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(sharded.CheckpointMismatch) as info:
        sharded.load_sharded(other, other_optimizer, tmp_path / "ckpt")
    assert str(info.value) == f"checkpoint {tmp_path / 'ckpt'} was written for another model: {difference}"
    assert isinstance(info.value, ValueError)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_bad_targets_are_refused_before_writing(tmp_path):
    model, optimizer = _tiny()
    with pytest.raises(ValueError) as info:
        sharded.save_sharded(model, optimizer, tmp_path / "missing" / "ckpt")
    missing = tmp_path / "missing" / "ckpt"
    assert str(info.value) == f"checkpoint directory '{missing}': its parent does not exist"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError) as info:
        sharded.save_sharded(model, optimizer, notes)
    assert str(info.value) == (f"checkpoint directory '{notes}' holds files that are not a "
                               "checkpoint; refusing to replace it")
    assert sorted(os.listdir(tmp_path)) == ["notes"]
    assert os.listdir(notes) == ["todo.txt"] and (notes / "todo.txt").read_text() == "keep me"
    with pytest.raises(FileNotFoundError) as info:
        sharded.load_sharded(model, optimizer, tmp_path / "nothing")
    assert str(info.value) == f"no checkpoint at {tmp_path / 'nothing'} (nor at nothing.prev)"


def test_unreadable_metadata_is_one_line(tmp_path):
    model, _ = _tiny()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(sharded.CheckpointMismatch) as info:
        sharded.check_fits(model, tmp_path / "ckpt")
    assert str(info.value) == f"{tmp_path / 'ckpt'} has unreadable checkpoint metadata (UnpicklingError)"


# ---------------------------------------------------------------- SIGKILL during a save

@pytest.mark.timeout(300)
@pytest.mark.parametrize("point, entries, loaded_from, loaded", [
    ("old_moved", [".checkpoint.saving-", "checkpoint.prev"], "checkpoint.prev", "A"),
    ("new_moved", ["checkpoint", "checkpoint.prev"], "checkpoint", "B"),
])
@pytest.mark.multiprocess
def test_sigkill_during_save_leaves_a_complete_checkpoint(tmp_path, point, entries, loaded_from, loaded):
    report = dcp_kill.kill_during_save(point, tmp_path, timeout=180)
    assert report["signal"] == -9
    assert [e[:len(".checkpoint.saving-")] if e.startswith(".") else e for e in report["entries"]] == entries
    assert (report["loaded_from"], report["loaded"], report["exact"]) == (loaded_from, loaded, True)
    # the next save cleans up what the killed one left
    assert dcp_kill.save_again(tmp_path) == ["checkpoint"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point, survivor, entries", [
    ("one_rank_mid_write", True, ["checkpoint"]),  # rank 0 fails on its own and removes the partial save
    ("every_rank_mid_write", False, [".checkpoint.saving-", "checkpoint"]),
])
@pytest.mark.multiprocess
def test_sigkill_of_saving_ranks_keeps_the_previous_checkpoint(tmp_path, point, survivor, entries):
    """A save by 2 FSDP2 ranks, each writing its own file, killed halfway through a file: on
    one rank (the other must notice and fail) or on both. Checkpoint A stays, whole."""
    report = dcp_kill.kill_ranks_during_save(point, tmp_path, timeout=180)
    assert not report["timed_out"], report["output"][-3000:]
    codes = report["returncodes"]
    assert codes[1] == -9 and (codes[0] not in (0, -9) if survivor else codes[0] == -9), report["output"][-3000:]
    if survivor:
        assert "Traceback" in report["output"]  # rank 0's save raised: it did not swap in a partial B
    assert [e[:len(".checkpoint.saving-")] if e.startswith(".") else e for e in report["entries"]] == entries
    assert (report["loaded_from"], report["loaded"], report["exact"]) == ("checkpoint", "A", True)
    assert dcp_kill.save_again(tmp_path) == ["checkpoint"]
