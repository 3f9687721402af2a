"""The worker's options are written once: defaults, command line and checks in WorkerArgs,
read the same way by the worker, node mode, the local cluster and the printed command."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from ddpguide.elastic import __main__ as cli
from ddpguide.elastic.cluster import LocalCluster
from ddpguide.elastic.node import command_line
from ddpguide.elastic.settings import AgentSettings, UsageError
from ddpguide.elastic.worker_args import WorkerArgs

CUSTOM = WorkerArgs(checkpoint="/shared/ckpt.pt", epochs=5, events="/shared/events.jsonl",
                    step_delay=0.1 + 0.2, samples=33, batch_size=7, timeout=12.5)


def test_argv_round_trips_in_both_spellings():
    assert WorkerArgs.parse(CUSTOM.argv()) == CUSTOM
    assert "--timeout" in CUSTOM.argv() and "--worker-timeout" in CUSTOM.argv(node=True)
    base = ["node", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", "h:1"]
    parsed = cli._parser().parse_args([*base, *CUSTOM.argv(node=True)])
    assert WorkerArgs.from_namespace(parsed) == CUSTOM
    # Without worker options, node mode's defaults are the worker's.
    parsed = cli._parser().parse_args([*base, "--checkpoint", "c.pt"])
    assert WorkerArgs.from_namespace(parsed) == WorkerArgs(checkpoint="c.pt")
    assert WorkerArgs.parse(["--checkpoint", "c.pt"]) == WorkerArgs(checkpoint="c.pt")


def test_the_arguments_are_frozen_and_a_field_is_an_option():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CUSTOM.epochs = 1  # type: ignore[misc]
    names = [f.name for f in dataclasses.fields(WorkerArgs)]
    flags = [a for a in CUSTOM.argv() if a.startswith("--")]
    assert flags == ["--" + n.replace("_", "-") for n in names]


def test_the_cluster_and_the_printed_command_use_the_same_argv(tmp_path):
    cluster = LocalCluster(tmp_path, epochs=7, step_delay=0.05, samples=64)
    command = cluster.node_command("A", 2)
    parsed = cli._parser().parse_args(command[command.index("node"):])
    assert WorkerArgs.from_namespace(parsed) == WorkerArgs(
        checkpoint=str(cluster.checkpoint), epochs=7, events=str(cluster.events_path),
        step_delay=0.05, samples=64)
    printed = shlex.split(command_line(AgentSettings(), CUSTOM))
    assert printed[printed.index("ddpguide.elastic.worker") + 1:] == CUSTOM.argv()


@pytest.mark.parametrize("change, node, message", [
    ({"epochs": 0}, False, "--epochs 0: must be at least 1"),
    ({"samples": 0}, False, "--samples 0: must be between 1 and 1000000"),
    ({"batch_size": -3}, False, "--batch-size -3: must be at least 1"),
    ({"step_delay": float("nan")}, False,
     "--step-delay nan: must be a number of seconds from 0 to 60"),
    ({"timeout": -1.0}, False, "--timeout -1: must be a number of seconds above 0, at most 604800"),
    ({"timeout": float("inf")}, True,
     "--worker-timeout inf: must be a number of seconds above 0, at most 604800"),
    ({"checkpoint": ""}, True, "--checkpoint '': must not be empty"),
    ({"events": ""}, True, "--events '': must not be empty"),
])
def test_checks_name_the_option_as_its_command_spells_it(change, node, message):
    with pytest.raises(UsageError) as info:
        dataclasses.replace(CUSTOM, **change).validate(node=node)
    assert str(info.value) == message
    assert CUSTOM.validate() is CUSTOM


def test_the_strategy_registry_agrees_with_the_strategy_objects():
    """Each entry's facts are its object's: the control plane asks the entry, the worker
    trains with what the entry builds."""
    import importlib

    from ddpguide.elastic.worker_args import STRATEGIES

    assert tuple(STRATEGIES) == ("ddp", "fsdp")
    assert WorkerArgs.strategy in STRATEGIES
    for name, choice in STRATEGIES.items():
        built = choice.build()
        assert (built.name, built.sharded) == (name, choice.sharded) == (choice.name, choice.sharded)
        assert choice.checkpoint_name == ("checkpoint" if built.sharded else "checkpoint.pt")
        for module in choice.preload:
            assert type(built).__module__ == importlib.import_module(module).__name__
    args = WorkerArgs.parse(["--checkpoint", "c", "--strategy", "fsdp"])
    assert args.strategy_choice is STRATEGIES["fsdp"] and type(args.strategy_choice.build()).__name__ == "FSDP2"
