"""``TrainConfig``: its fields write ``python -m ddpguide.train``'s options, and it checks itself."""

from __future__ import annotations

import dataclasses

import pytest

from ddpguide.train import cli as train_cli
from ddpguide.train.config import TrainConfig


def test_a_config_writes_the_command_line_that_reads_back_to_it():
    config = TrainConfig(dataset="digits", epochs=4, batch_size=16, lr=0.125, seed=7,
                         max_steps_per_epoch=3, checkpoint="c.pt", amp="bf16", sync_bn=True,
                         evaluate=False, log=False)
    argv = config.argv()
    assert argv == ["--dataset", "digits", "--epochs", "4", "--batch-size", "16", "--lr", "0.125",
                    "--seed", "7", "--max-steps-per-epoch", "3", "--checkpoint", "c.pt",
                    "--amp", "bf16", "--sync-bn", "--no-eval", "--quiet"]
    assert train_cli.config_from_args(train_cli.build_parser().parse_args(argv)) == config
    assert TrainConfig().argv() == ["--dataset", "auto", "--epochs", "3", "--batch-size", "32",
                                    "--lr", "0.02", "--seed", "0", "--amp", "off"]


def test_settings_without_an_option_stay_out_of_the_command_line():
    options = {f.name for f in TrainConfig.options()}
    assert {f.name for f in dataclasses.fields(TrainConfig)} - options == {
        "model", "momentum", "data_seed", "progress", "step_delay_s"}


def test_a_bad_value_is_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="epochs must be >= 0, got -2"):
        dataclasses.replace(TrainConfig(), epochs=-2)
