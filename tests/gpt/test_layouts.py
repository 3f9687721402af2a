"""Chapter 14: the GPT of book/programs/gpt/ on every layout equals one process (float64,
3 AdamW steps with clipping, loss and every parameter within 1e-10), and a checkpoint of
one layout resumes on another with the losses of the uninterrupted run."""

from __future__ import annotations

import pytest

from ddpguide.gpt.layouts import FOUR_D, LAYOUTS, check_options, compare, launch, trained
from ddpguide.launch.report import ReportError

TOLERANCE = 1e-10


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS[1:]])
def test_every_layout_equals_one_process(table, name):
    row = table[0][name]
    assert row["loss_difference"] <= TOLERANCE, row
    assert row["parameter_difference"] <= TOLERANCE, row


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_losses_come_in_the_report_and_the_out_folder_holds_only_parameters(table):
    for name, result in table[1].items():
        assert len(result.losses) == 3 and result.first_step == 0, name
        out = result.run.workdir.parent
        written = {p.name for p in out.iterdir()} - {result.run.workdir.name}
        assert written and all(n.startswith("params-pp") and n.endswith(".pt") for n in written), written


GOOD = {"checks": [], "losses": [5.5, 5.25], "first_step": 0, "layout": {"tp": 2}}


def test_a_report_of_the_program_gives_its_losses_first_step_and_layout():
    assert trained(GOOD, "train.py") == ([5.5, 5.25], 0, {"tp": 2})


@pytest.mark.parametrize("report", [None, {"checks": []}, {**GOOD, "losses": None},
                                    {**GOOD, "losses": ["5.5"]}, {**GOOD, "first_step": 1.0},
                                    {**GOOD, "first_step": True}, {**GOOD, "layout": None}],
                         ids=["none", "only-checks", "no-losses", "loss-a-string", "step-a-float",
                              "step-a-bool", "no-layout"])
def test_a_report_without_losses_first_step_or_layout_is_refused_in_one_line(report):
    with pytest.raises(ReportError) as refused:
        trained(report, "train.py --tp 2")
    assert str(refused.value) == ("train.py --tp 2: its report holds no losses (numbers), "
                                  "first_step (a whole number) and layout (an object)")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return launch((), 1, tmp_path_factory.mktemp("whole"), extra=check_options(steps=5))


def resumed(tmp_path, saver, loader):
    """Steps 1-3 on the saver's layout, then steps 4-5 on the loader's from its checkpoint."""
    (save_ranks, save_options), (load_ranks, load_options) = saver, loader
    checkpoint = tmp_path / "checkpoint"
    launch(save_options, save_ranks, tmp_path / "first", extra=(*check_options(steps=3), "--save", str(checkpoint)))
    return launch(load_options, load_ranks, tmp_path / "second",
                  extra=(*check_options(steps=5), "--load", str(checkpoint)))


FSDP_TP = (4, ("--dp-shard", "2", "--tp", "2"))
PP_FSDP = (4, ("--pp", "2", "--dp-shard", "2"))
ONE = (1, ())
EIGHT = (8, ("--pp", "2", "--dp-shard", "2", "--tp", "2"))
FSDP = (2, ("--dp-shard", "2"))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("saver, loader", [(FSDP_TP, PP_FSDP), (FSDP_TP, ONE), (EIGHT, FSDP)],
                         ids=["fsdp-tp-to-pp-fsdp", "fsdp-tp-to-one", "8-ranks-to-2"])
def test_a_checkpoint_resumes_on_another_layout(tmp_path, uninterrupted, saver, loader):
    second = resumed(tmp_path, saver, loader)
    assert second.first_step == 3
    # steps 1-3 from the checkpoint's record, 4-5 trained now: none lost, none repeated
    assert len(second.losses) == 5
    for mine, whole in zip(second.losses, uninterrupted.losses):
        assert abs(mine - whole) <= TOLERANCE, (second.losses, uninterrupted.losses)
    worst = max((second.parameters[k] - uninterrupted.parameters[k]).abs().max().item()
                for k in uninterrupted.parameters)
    assert worst <= TOLERANCE


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_the_16_rank_4d_layout_equals_one_process(tmp_path):
    name, ranks, options = FOUR_D
    reference = launch((), 1, tmp_path / "one")
    result = launch(options, ranks, tmp_path / "four-d", timeout=1000, name=name)
    assert max(compare(reference, result)) <= TOLERANCE
