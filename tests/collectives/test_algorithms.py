"""Collectives from scratch: the primitives, and every hand-written all-reduce vs gloo's.

Each world size is started once (a start costs seconds) and runs many checks;
the tests below read its results.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ddpguide.bench import allreduce as bench
from ddpguide.collectives import algorithms as collectives
from ddpguide.collectives import demos as demos
from ddpguide.launch.spawn import WorkerError, spawn

TINY_BENCH = ([4096, 2**20], 1, bench.CASES, 1)  # exercises the suite, times nothing


def _ring_exchange() -> dict:
    """Worker: each rank sends its rank to the right and receives from the left, in one
    :func:`ddpguide.collectives.p2p.send_recv` (the rule every hand-written exchange uses)."""
    import torch.distributed as dist

    from ddpguide.collectives.p2p import send_recv, wait

    rank, world = dist.get_rank(), dist.get_world_size()
    mine, got = torch.full((3,), float(rank)), torch.empty(3)
    wait(send_recv(mine, (rank + 1) % world, got, (rank - 1) % world))
    # an empty message is skipped on both sides (gloo never completes a 0-byte send)
    skipped = send_recv(torch.empty(0), (rank + 1) % world, torch.empty(0), (rank - 1) % world)
    return {"got": got.tolist(), "skipped": len(skipped)}


def _calls(world: int) -> dict[str, tuple]:
    calls = {"exchange": (_ring_exchange,), "library": (demos.compare_with_library,),
             "trace": (demos.ring_trace_demo, 2),
             "bench": (bench.measure, *TINY_BENCH)}
    if world == 4:
        calls["primitives"] = (demos.primitives_demo,)
    return calls


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_passes_a_ring_on_and_skips_empty_messages(spawned, world):
    for rank, result in enumerate(spawned(world)):
        assert result["exchange"] == {"got": [float((rank - 1) % world)] * 3, "skipped": 0}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_hand_written_all_reduces_equal_gloo(spawned, world):
    per_rank = spawned(world)
    expected_keys = {(name, size, dtype, kind)
                     for name in (*collectives.ALGORITHMS, "pipelined_ring/64B", "auto")
                     for size in (1, 7, 1001) for dtype in (torch.float32, torch.float64)
                     for kind in ("random", "integers")}
    for key in expected_keys:
        inputs = [result["library"][key][2] for result in per_rank]
        if key[3] == "random":  # each rank brings its own values
            assert not torch.equal(inputs[0], inputs[1])
        exact_sum = torch.stack(inputs).double().sum(0)
        for rank, result in enumerate(per_rank):
            ours, library, _ = result["library"][key]
            assert ours.dtype == key[2] and ours.shape == (key[1],)
            torch.testing.assert_close(library, exact_sum.to(key[2]), msg=f"gloo {key}")
            if key[3] == "integers":  # no rounding: every summation order agrees exactly
                assert torch.equal(ours, library), (rank, key)
            else:
                torch.testing.assert_close(ours, library, msg=f"rank {rank} {key}")
            # replicas must not drift apart: the same bits on every rank
            assert torch.equal(ours, per_rank[0]["library"][key][0]), (rank, key)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_trace_follows_the_schedule(spawned, world):
    per_chunk = 2
    states = [r["trace"] for r in spawned(world)]
    total = sum(10.0**r for r in range(world))
    for rank in range(world):
        assert len(states[rank]) == 2 * (world - 1) + 1
        assert torch.equal(states[rank][0], torch.full((world * per_chunk,), 10.0**rank,
                                                       dtype=torch.float64))
        assert torch.equal(states[rank][-1], torch.full_like(states[rank][0], total))
        after_reduce_scatter = states[rank][world - 1].view(world, per_chunk)
        owned = (rank + 1) % world  # the chunk this rank has fully reduced
        assert torch.all(after_reduce_scatter[owned] == total)
        for step, (_, _, received) in enumerate(collectives.ring_steps(world, rank), 1):
            changed = (states[rank][step] != states[rank][step - 1]).view(world, per_chunk)
            assert changed.any(dim=1).nonzero().flatten().tolist() == [received], (rank, step)


@pytest.mark.timeout(240)
def test_primitives_move_what_they_promise(spawned):
    per_rank = [r["primitives"] for r in spawned(4)]
    world = 4
    vec = [torch.arange(world, dtype=torch.float32) + 10 * r for r in range(world)]
    total = sum(vec)
    after = {name: [r[name][1] for r in per_rank] for name in per_rank[0] if name != "barrier"}
    assert [t.tolist() for t in after["send/recv"]] == [vec[0].tolist(), vec[0].tolist(),
                                                         vec[2].tolist(), vec[2].tolist()]
    assert all(torch.equal(t, vec[0]) for t in after["broadcast"])
    assert [t.item() for t in after["scatter"]] == vec[0].tolist()
    assert after["gather"][0].tolist() == [0.0, 10.0, 20.0, 30.0]
    assert torch.equal(after["reduce"][0], total)
    assert all(torch.equal(t, total) for t in after["all-reduce"])
    assert all(t.tolist() == [0.0, 10.0, 20.0, 30.0] for t in after["all-gather"])
    assert [t.item() for t in after["reduce-scatter"]] == total.tolist()
    for r, t in enumerate(after["all-to-all"]):
        assert t.tolist() == [vec[src][r].item() for src in range(world)]
    for r in range(world):  # "before" is what the rank started with
        assert torch.equal(per_rank[r]["all-reduce"][0], vec[r])
    arrivals = [r["barrier"][0] for r in per_rank]
    departures = [r["barrier"][1] for r in per_rank]
    assert min(departures) >= max(arrivals)  # nobody leaves before the last one arrives


@pytest.mark.timeout(240)
def test_benchmark_report_from_real_measurements(spawned, tmp_path):
    results = {world: spawned(world)[0]["bench"] for world in (2, 4)}
    for by_size in results.values():
        assert sorted(by_size) == TINY_BENCH[0]
        for times in by_size.values():
            assert set(times) == set(bench.CASES) and all(t > 0 for t in times.values())
    report = bench.build_report(results)
    one_mb_4 = results[4][2**20]
    chosen = collectives.choose_algorithm(2**20, 4)
    assert report.ratios["ring_over_gloo_1mb_4ranks"] == one_mb_4[chosen] / one_mb_4["gloo"]
    assert "ring_over_gloo_64mb" not in report.ratios  # not measured, not reported
    assert f"({one_mb_4[chosen] / one_mb_4['gloo']:.2f}x {chosen})" in report.table()
    report.write_json(tmp_path / "allreduce.json")
    data = json.loads((tmp_path / "allreduce.json").read_text())
    assert {"suite", "machine", "measurements", "ratios"} <= set(data)
    assert len(data["measurements"]) == 2 * 2 * len(bench.CASES)


def test_benchmark_ratios_are_taken_within_a_process_group_then_the_median():
    mb64 = 64 * 2**20

    def group(gloo: float, ring: float) -> dict:
        times = dict.fromkeys(bench.CASES, ring)
        times["gloo"] = gloo
        return {mb64: times}

    # Ratios 2.0, 0.5 and 1.0: their median is 1.0. The ratio of the median
    # times (2.0 / 1.0) would say 2.0; the groups' own ratios say otherwise.
    groups = [group(1.0, 2.0), group(4.0, 2.0), group(1.0, 1.0)]
    seconds, vs_gloo = bench.combine_groups(groups)
    assert seconds[mb64]["gloo"] == 1.0 and seconds[mb64]["ring"] == 2.0
    assert vs_gloo[mb64]["ring"] == 1.0 and vs_gloo[mb64]["gloo"] == 1.0
    report = bench.build_report({2: groups})
    assert report.ratios["ring_over_gloo_64mb"] == 1.0
    assert report.ratios["plain_ring_over_gloo_64mb"] == 1.0
    assert "ring_over_gloo_64mb per process group: 2.00, 0.50, 1.00" in report.notes
    assert "medians over 3 process groups" in report.table()


def test_ring_schedule_passes_each_chunk_once_around():
    for world in (2, 3, 4, 5):
        schedules = [collectives.ring_steps(world, r) for r in range(world)]
        for step in range(2 * (world - 1)):
            for rank in range(world):
                left = (rank - 1) % world
                # what I receive at this step is what my left neighbour sends
                assert schedules[rank][step][2] == schedules[left][step][1]
        for rank in range(world):
            reduced = [received for phase, _, received in schedules[rank] if phase == "reduce-scatter"]
            gathered = [received for phase, _, received in schedules[rank] if phase == "all-gather"]
            assert sorted(reduced + [rank]) == list(range(world))
            assert sorted(gathered + [(rank + 1) % world]) == list(range(world))


def test_choice_of_algorithm_by_size():
    assert collectives.choose_algorithm(2**20, 4) == "recursive_doubling"
    assert collectives.choose_algorithm(64 * 2**20, 4) == "pipelined_ring"
    assert collectives.choose_algorithm(collectives.SMALL_MESSAGE_BYTES, 2) == "pipelined_ring"


def test_bad_input_is_refused_before_any_message():
    with pytest.raises(ValueError, match=r"^unknown all-reduce algorithm 'tree': choose one of "
                                         r"naive, ring, pipelined_ring, recursive_doubling or 'auto'$"):
        collectives.all_reduce(torch.ones(3), "tree")
    with pytest.raises(ValueError, match=r"^all-reduce by hand needs a contiguous tensor"):
        collectives.ring_all_reduce(torch.ones(3, 4).t())
    with pytest.raises(TypeError, match=r"^expected a torch.Tensor, got list$"):
        collectives.naive_all_reduce([1.0, 2.0])


@pytest.mark.timeout(120)
def test_a_skipped_collective_times_out_with_a_message():
    # Without the process group's timeout the other ranks would wait forever;
    # spawn's own timeout (SpawnTimeout) would then be the failure, not this.
    with pytest.raises(WorkerError) as caught:
        spawn(demos.skip_a_collective, 3, 1, "busy", collective_timeout=3, timeout=90,
              echo=False)
    assert caught.value.rank in (0, 2)
    assert "Timed out waiting 3000ms" in caught.value.details
    assert "skip_a_collective" in caught.value.details  # the traceback names the call site


@pytest.mark.timeout(120)
def test_debug_mode_names_the_mismatched_collectives():
    # two ranks (fresh interpreters: the variable is read by ``import torch.distributed``)
    with pytest.raises(WorkerError) as caught:
        spawn(demos.skip_a_collective, 2, 1, "next", collective_timeout=30, timeout=90,
              echo=False, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "Detected mismatch between collectives on ranks" in caught.value.details
    # PyTorch's wording; either side may report first
    assert re.search(r"Tensor Tensor shapes: (4vs 1|1vs 4)", caught.value.details)
