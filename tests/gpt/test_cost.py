"""Chapter 14: train.py --cost predicts the bytes of every collective a step runs, and the
count equals it exactly, per kind and per rank; parameters, gradients, AdamW state and
activations measured within 10% of the prediction, FSDP2's unsharded copies within 1%;
the alpha-beta fit recovers its parameters."""

from __future__ import annotations

import pytest

from ddpguide.gpt.cost import (
    KINDS,
    MEMORY,
    compare,
    fit_alpha_beta,
    growing_seconds,
    measure,
    parse,
    predict_from_narrow,
    ring_steps,
    wire_bytes,
)
from ddpguide.gpt.layouts import CHECK, LAYOUTS
from ddpguide.launch.programs import run
from ddpguide.launch.report import ReportError
from tests.programs.report_support import assert_report_agrees

#: cases the equivalence table does not run: launched here
OWN_CASES = [("TP x CP 2 x 2, checkpointed", 4, ("--tp", "2", "--cp", "2", "--checkpoint-activations")),
             ("HSDP 2 x 2, 2 accumulations", 4, ("--dp-replicate", "2", "--dp-shard", "2",
                                                  "--accumulate", "2"))]
TABLE_CASES = [name for name, _, _ in LAYOUTS[1:]]


def check_counted_bytes(result: dict, options: tuple[str, ...]) -> None:
    found = compare(result)
    for kind in KINDS:
        assert found["bytes"][kind]["counted"] == found["bytes"][kind]["predicted"], (kind, found)
        if kind != "all_to_all":  # routing decides each rank's share of the all-to-all
            assert found["per_rank"][kind], (kind, result["predicted"]["bytes"], result["counted"])
    assert sum(v["counted"] for v in found["bytes"].values()) > 0
    routed = "--ep" in options  # a rank's expert rows depend on the routing: all ranks together
    for part in MEMORY:
        if routed and "--pp" in options and part == "activations":
            continue  # a stage's peak over micro-batches routed unevenly: above any mean
        ratio = found["memory_mean" if routed and part == "activations" else "memory"][part]
        assert 0.9 <= ratio <= 1.1, (part, found["memory"], found["memory_mean"])
    # FSDP2's gathered copies and their gradients, counted at every saved tensor and every
    # gradient: as predicted on every rank (1.0 where the layout has no FSDP2)
    assert 0.99 <= found["memory"]["unsharded"] <= 1.01, found["memory"]
    assert result["predicted"]["device"] == "cpu" and result["predicted"]["attention"] == "cpu"


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TABLE_CASES)
def test_counted_bytes_equal_predicted_on_the_table_s_layouts(table, name):
    """The runs of the equivalence table (tests/gpt/conftest.py), each with --cost."""
    options = next(options for n, _, options in LAYOUTS if n == name)
    check_counted_bytes(parse(table[1][name].run), options)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,ranks,options", OWN_CASES, ids=[c[0] for c in OWN_CASES])
def test_counted_bytes_equal_predicted(name, ranks, options, tmp_path):
    result, _ = measure(options, ranks, workdir=tmp_path)
    check_counted_bytes(result, options)
    if "--accumulate" in options:
        # FSDP2's 3 groups (2 blocks and the root) are gathered in each of the 2 micro-steps,
        # forward and backward, but reduce-scattered (and all-reduced over the replicas) once
        calls = result["calls"][0]
        assert calls["all_gather/2"][0] == 2 * 2 * 3 and calls["reduce_scatter/2"][0] == 3, calls


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_one_process_sends_nothing_and_its_memory_is_predicted(table):
    done = table[1]["1 process"].run
    result = parse(done)
    assert result["counted"] == [dict.fromkeys(KINDS, 0)]
    found = compare(result)
    assert all(0.9 <= found["memory"][part] <= 1.1 for part in MEMORY), found["memory"]
    # the utilisation is the step's model FLOPs over its time and the measured peak; its size
    # is the benchmark's to report (a matmul timed once on a busy machine may run slower
    # than the step did, so no bound below 1 is asserted here)
    flops = result["predicted"]["flops"]
    assert result["mfu"] == pytest.approx(flops / result["step_seconds"] / result["peak_flops"])
    assert result["mfu"] > 0 and result["peak_flops"] > 0
    assert "cost all_gather: predicted 0 B, counted 0 B (all ranks)" in done.program_lines()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_report_says_what_the_cost_lines_print(tmp_path):
    result, done = measure(("--dp-shard", "2"), 2, workdir=tmp_path)
    assert_report_agrees(done)  # no check lines, no checks
    lines = done.program_lines()
    for kind in KINDS:
        predicted = sum(rank[kind] for rank in result["predicted"]["bytes"])
        counted = sum(rank[kind] for rank in result["counted"])
        assert any(line.startswith(f"cost {kind}: predicted {predicted} B, counted {counted} B")
                   for line in lines), (kind, lines)
    assert done.report["losses"] and len(done.report["losses"]) == 3
    assert not any(line.startswith("cost: {") for line in lines)  # the JSON is in the file only
    without = run("gpt/train.py", *CHECK, "--steps", "1", echo=False, workdir=tmp_path / "plain",
                  report=True)
    with pytest.raises(ReportError, match="its report holds no cost"):
        parse(without)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_rate_window_times_every_rank_before_each_step(tmp_path):
    """--rate-window: each rank times the MLP's matmul alone in a window (alone_flops: their mean),
    then before each step every rank in a window of its own, all ranks at once; shared_flops is
    the median, over the windows before the timed steps (the two first steps are not timed), of
    the ranks' rate together at the slowest one's pace (a step waits for its slowest rank). The steps' own times are not
    in it: a run without windows reports none."""
    extra = (*CHECK[:-1], "4", "--rate-window", "0.05")
    result, done = measure(("--dp-replicate", "2"), 2, extra=extra, workdir=tmp_path)
    windows = result["shared_windows"]
    assert len(windows) == 4 and all(len(w) == 2 and min(w) > 0 for w in windows), windows
    together = sorted(2 * min(w) for w in windows[2:])  # both ranks at the slower one's rate
    assert result["shared_flops"] == together[1]  # the median of two: the upper, as the step's median
    assert result["alone_flops"] > 0
    assert any(line.startswith("cost rate: all 2 ranks at once got ") and "median of 2 windows of 0.05 s" in line
               for line in done.program_lines())
    plain, _ = measure(("--dp-replicate", "2"), 2, extra=(*CHECK[:-1], "4"), workdir=tmp_path / "plain")
    assert plain["shared_flops"] is None is plain["alone_flops"] and plain["shared_windows"] == []


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    alpha, beta = 50e-6, 1e-9
    samples = []
    for kind, ranks, size in [("all_reduce", 2, 4096), ("all_reduce", 4, 2**20),
                              ("all_gather", 4, 2**16), ("send_recv", 2, 2**22)]:
        samples.append((kind, ranks, size, alpha * ring_steps(kind, ranks)
                        + beta * wire_bytes(kind, ranks, size)))
    a, b = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)


def test_fit_alpha_beta_refuses_samples_of_one_shape():
    with pytest.raises(ValueError, match="do not separate latency from bandwidth"):
        fit_alpha_beta([("all_reduce", 2, 0, 1e-4), ("all_reduce", 2, 0, 2e-4)])


def _step(flops: float, put_in: float, seconds: float, ranks: int = 4) -> dict:
    """A --cost result as the bench reads it: every rank the same, one all-reduce a step."""
    return {"memory": [{}] * ranks, "predicted": {"flops": flops}, "peak_flops": 1e9,
            "step_seconds": seconds, "calls": [{f"all_reduce/{ranks}": (1, put_in)}] * ranks}


def test_the_narrow_model_s_step_plus_what_grows_is_the_prediction():
    wide, narrow = _step(8e9, 4e6, seconds=9.0), _step(8e7, 4e4, seconds=0.5)
    beta, efficiency = 1e-9, 0.5
    # compute: flops / 4 ranks / (0.5 x 1e9), twice as long on 2 cores; wire: 2 (4 - 1) / 4 x bytes x beta
    grow_wide = 8e9 / 4 / 0.5e9 * 2 + 1.5 * 4e6 * beta
    grow_narrow = 8e7 / 4 / 0.5e9 * 2 + 1.5 * 4e4 * beta
    assert predict_from_narrow(wide, narrow, beta, efficiency, cores=2) == pytest.approx(
        0.5 + grow_wide - grow_narrow, rel=1e-12)
    # no core sharing with a core per rank; a pipeline of 2 stages and 4 micro-batches is 5/4 longer
    assert growing_seconds(wide, beta, efficiency, cores=4) == pytest.approx(4.0 + 6e-3, rel=1e-12)
    assert growing_seconds({**wide, "microbatches": 4}, beta, efficiency, pipeline_stages=2,
                           cores=4) == pytest.approx(5.0 + 6e-3, rel=1e-12)
