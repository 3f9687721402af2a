"""The failures Slurm handles, run on a 3-node Slurm: a preempted job and a job that lost a node
both end with the model of a run never stopped, bit for bit; a job failing on its input is not
requeued."""

from __future__ import annotations

import pytest

from ddpguide.cluster import Spec
from ddpguide.launch import report as reports
from ddpguide.slurm import config, runs, up

needs_slurm = pytest.mark.skipif(config.missing_prerequisite() is not None,
                                 reason=str(config.missing_prerequisite()))
EPOCHS = 2  # as chapter 18's runs: the stop lands a few steps into the second, the last


@pytest.fixture(scope="module")
def slurm(slurm_machine):
    with up(Spec(nodes=3)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return runs.reference(EPOCHS, tmp_path_factory.mktemp("reference"))


@pytest.mark.multiprocess
@needs_slurm
def test_a_job_failing_on_its_input_fails_once_and_is_not_requeued(slurm, tmp_path):
    run = runs.bad_input(slurm, tmp_path)
    assert (run.fields["JobState"], run.fields["Restarts"], run.report) == ("FAILED", "0", None)
    assert "error: argument --epochs/--batch-size: out of range (0, 32)" in run.output


@pytest.mark.multiprocess
@needs_slurm
def test_a_preempted_job_checkpoints_requeues_itself_and_loses_nothing(slurm, tmp_path, reference):
    run = runs.preempted(slurm, tmp_path, EPOCHS)
    assert (run.fields["JobState"], run.fields["Restarts"]) == ("COMPLETED", "1")
    assert reports.failed(run.report) == []
    first, second = run.report["history"]
    assert (first["why"], first["restart"], second["restart"]) == ("signal", 0, 1)
    assert 0 < first["to"] < run.report["steps"] and first["to"] % (run.report["steps"] // EPOCHS)
    assert "USR1: requeueing job" in run.output
    assert run.report["params_sha256"] == reference["params_sha256"]


@pytest.mark.multiprocess
@pytest.mark.slow
@needs_slurm
def test_a_job_that_loses_a_node_is_requeued_on_the_others_and_resumes(slurm, tmp_path, reference):
    run = runs.lost_node(slurm, tmp_path, lose=1, epochs=EPOCHS)
    try:
        assert (run.fields["JobState"], run.fields["Restarts"]) == ("COMPLETED", "1")
        assert runs.expand(slurm, run.fields["NodeList"]) == ["node0", "node2"]
        assert reports.failed(run.report) == []
        first, second = run.report["history"]
        assert first["why"] == "epoch" and second["from"] == first["to"] > 0
        assert run.report["params_sha256"] == reference["params_sha256"]
    finally:
        slurm.restore_node(slurm.cluster.node(1))
        slurm.wait_for_states("idle", 60)


def test_the_programs_history_check_fails_on_a_gap_a_repeat_or_a_short_run():
    from ddpguide.launch.programs import load

    checks = load(runs.PROGRAM).history_checks
    whole = [{"from": 0, "to": 30}, {"from": 30, "to": 69}]
    assert [c["ok"] for c in checks(whole, 69)] == [True, True]
    assert [c["ok"] for c in checks([whole[0], {"from": 32, "to": 69}], 69)] == [False, False]
    assert [c["ok"] for c in checks([whole[0], {"from": 28, "to": 69}], 69)] == [False, False]
    assert [c["ok"] for c in checks(whole, 70)] == [True, False]
