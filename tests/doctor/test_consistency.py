"""Rank 0's verdict on the ranks' records, rule by rule (no process needed)."""

from __future__ import annotations

from ddpguide.doctor.consistency import Problem, verdict


def record(rank: int, world: int = 2, host: str = "a", local_rank: int | None = None,
           local_world: int = 2, gpu: str | None = None, **changes) -> dict:
    """A healthy rank's record, as facts.rank_facts writes it."""
    local_rank = rank % local_world if local_rank is None else local_rank
    base = {"rank": rank, "world_size": world, "local_rank": local_rank,
            "local_world_size": local_world, "group_rank": rank // local_world,
            "master_addr": "10.0.0.1", "master_port": 29500, "agent_store": False,
            "host": host, "pid": 100 + rank, "launcher": "torchrun",
            "variables": {"LOCAL_WORLD_SIZE": str(local_world)},
            "versions": {"torch": "2.14.1"}, "backend": "gloo", "device": "cpu",
            "gpus_visible": 0, "gpus_simulated": False, "gpu_id": gpu, "connect_ms": 0.2}
    base.update(changes)
    return base


def lines(problems: list[Problem]) -> list[str]:
    return [p.line() for p in problems]


def test_a_healthy_world_has_no_problem():
    assert verdict([record(0), record(1)], 2, 5, "10.0.0.1:29500") == []
    two_nodes = [record(r, world=4, host="ab"[r // 2], local_world=2, gpu=f"G{r % 2}") for r in range(4)]
    assert verdict(two_nodes, 4, 5, "10.0.0.1:29500") == []


def test_missing_rank_is_named_with_what_arrived():
    assert lines(verdict([record(0, world=3), record(1, world=3)], 3, 5, "h:1")) == [
        "PROBLEM rank 2 (host unknown): did not arrive at h:1 within 5 s (WORLD_SIZE=3; arrived: ranks 0, 1)"]


def test_world_size_and_endpoint_must_agree():
    found = lines(verdict([record(0), record(1, world=3, master_port=29501)], 2, 5, "h:1"))
    assert found == ["PROBLEM rank 1 (host a): WORLD_SIZE=3, but rank 0 has WORLD_SIZE=2",
                     "PROBLEM rank 1 (host a): MASTER_PORT=29501, but rank 0 has MASTER_PORT=29500"]


def test_duplicate_rank_names_both_processes():
    found = lines(verdict([record(0), record(1, pid=7), record(1, host="b", pid=8, local_rank=0)], 2, 5, "h:1"))
    assert found[0] == "PROBLEM rank 1 (host b): RANK=1 is used by 2 processes (pid 7 on a, pid 8 on b)"


def test_local_rank_out_of_range_and_shared():
    found = lines(verdict([record(0), record(1, local_rank=2)], 2, 5, "h:1"))
    assert "PROBLEM rank 1 (host a): LOCAL_RANK=2 is not smaller than LOCAL_WORLD_SIZE=2" in found
    found = lines(verdict([record(0), record(1, local_rank=0)], 2, 5, "h:1"))
    assert found == ["PROBLEM rank 1 (host a): LOCAL_RANK=0 is shared by ranks 0, 1 on node 0"]


def test_local_world_size_must_count_the_ranks_of_the_node():
    found = lines(verdict([record(0, local_world=1), record(1, local_world=1, local_rank=0, group_rank=0)],
                          2, 5, "h:1"))
    assert "PROBLEM rank 0 (host a): node 0 runs 2 ranks (0, 1) but LOCAL_WORLD_SIZE says 1" in found


def test_two_ranks_on_one_gpu():
    found = lines(verdict([record(0, gpu="G0", gpus_visible=1), record(1, gpu="G0", gpus_visible=1)],
                          2, 5, "h:1"))
    assert found == ["PROBLEM rank 1 (host a): LOCAL_RANK=1 would use GPU G0, as rank 0 (LOCAL_RANK=0) "
                     "does: two ranks on one GPU (1 GPU(s) visible, LOCAL_WORLD_SIZE=2)"]
    # the same GPU id on two different hosts is two GPUs
    assert verdict([record(0, world=2, local_world=1, gpu="G0"),
                    record(1, world=2, local_world=1, local_rank=0, host="b", gpu="G0")], 2, 5, "h:1") == []


def test_versions_and_strays():
    found = lines(verdict([record(0), record(1, versions={"torch": "2.13.0"})], 2, 5, "h:1",
                          strays=["5|c|RANK=5 is not smaller than WORLD_SIZE=2"]))
    assert found == ["PROBLEM rank 5 (host c): RANK=5 is not smaller than WORLD_SIZE=2",
                     "PROBLEM rank 1 (host a): torch 2.13.0, but rank 0 runs torch 2.14.1"]


def test_a_gpu_with_little_free_memory_another_process_or_a_wrong_matmul_is_named():
    def health(free=79 * 2**30, processes=(), error=0.0):
        return {"free_bytes": free, "total_bytes": 80 * 2**30, "processes": list(processes),
                "matmul_error": error}
    ranks = [record(0, gpu="G0", gpu_health=health()), record(1, gpu="G1", gpu_health=health())]
    assert verdict(ranks, 2, 5, "10.0.0.1:29500") == []
    ranks[1]["gpu_health"] = health(free=20 * 2**30, error=float("nan"), processes=[
        {"pid": 100, "name": "python", "used_mib": 900},  # rank 0 of this job, on host a
        {"pid": 4242, "name": "other_job", "used_mib": 61440}])
    assert lines(verdict(ranks, 2, 5, "10.0.0.1:29500")) == [
        "PROBLEM rank 1 (host a): GPU G1 has 20.0 GiB free of 80.0 GiB (25%) before the job "
        "starts: another process holds the rest",
        "PROBLEM rank 1 (host a): GPU G1 is also used by pid 4242 (other_job, 61440 MiB), not a "
        "rank of this job",
        "PROBLEM rank 1 (host a): GPU G1 computed a 256 x 256 float64 matmul with a relative error "
        "of nan against the CPU (at most 1e-09): a faulty GPU, driver or clock"]
