"""A layout as train.py's options: every printed line is one train.py's own parser accepts,
for exactly the ranks planned; what train.py cannot run is refused with the reason."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from ddpguide.launch.programs import path_of
from ddpguide.plan import catalog, render, search

PARSE = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import train
out = []
for world, argv in json.load(open(sys.argv[1])):
    os.environ["WORLD_SIZE"] = str(world)
    try:
        args, layout, config = train.parse_args(argv)
        out.append({"ok": True, "world": layout.world, "seq": config.seq, "batch": args.batch,
                    "layers": config.layers, "dim": config.dim, "dtype": args.dtype, "bf16": args.bf16})
    except SystemExit as ended:
        out.append({"ok": False, "code": ended.code})
json.dump(out, open(sys.argv[2], "w"))
"""


def parsed(lines: list[str], tmp_path) -> list[dict]:
    """Each ``torchrun`` line's ranks and train.py's arguments, parsed by train.py itself."""
    cases = []
    for line in lines:
        words = shlex.split(line)
        at = words.index("train.py")
        nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        cases.append((nodes * int(words[words.index("--nproc-per-node") + 1]), words[at + 1:]))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    subprocess.run([sys.executable, "-c", PARSE, str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                   cwd=path_of("gpt/train.py").parent, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": ""}, capture_output=True)
    return json.loads((tmp_path / "out.json").read_text())


@pytest.fixture(scope="module")
def p():
    return search.program()


def test_every_rendered_command_is_accepted_by_train_py(p, tmp_path):
    lines, planned = [], []
    for name, world, per_node, shape in (("gpt-check", 4, 2, {}), ("gpt-check", 8, 4, {"kv_heads": 2}),
                                         ("gpt-check", 4, 4, {"experts": 4, "top_k": 2})):
        model = catalog.model(p, name, **shape)
        for lay in search.layouts(p, model, world, 8, 16, runnable=True):
            for dtype in ("float32", "bf16"):
                found = render.command(lay, per_node, model, 16, 8, dtype)
                assert len(found) == max(1, world // per_node)
                lines += found
                planned += [(lay.world, dtype)] * len(found)
    results = parsed(lines, tmp_path)
    refused = [line for line, r in zip(lines, results) if not r["ok"]]
    assert not refused, refused[:3]
    assert [(r["world"], "bf16" if r["bf16"] else r["dtype"]) for r in results] == planned
    assert {(r["seq"], r["batch"], r["layers"], r["dim"]) for r in results} == {(16, 8, 2, 32)}
    assert len(lines) > 100


def test_a_planted_bad_line_is_refused_by_the_parser(tmp_path):
    """The parse check can fail: train.py refuses an interleaved schedule and a layout of other ranks."""
    results = parsed(["torchrun --standalone --nproc-per-node 4 train.py --pp 2 --dp-shard 2 --schedule "
                      "Interleaved1F1B", "torchrun --standalone --nproc-per-node 8 train.py --dp-shard 4"], tmp_path)
    assert results == [{"ok": False, "code": 2}, {"ok": False, "code": 2}]


@pytest.mark.parametrize("changes, message", [
    ({"schedule": "Interleaved1F1B", "pp": 2, "dp_shard": 2, "microbatches": 2},
     "train.py runs the schedules 1F1B and GPipe, not Interleaved1F1B"),
    ({"ac": "selective", "dp_shard": 4}, "train.py checkpoints whole blocks only (--checkpoint-activations), "
                                         "not selectively"),
    ({"zero": 1, "dp_replicate": 4}, "train.py has no ZeRO-1 (its sharding is FSDP's: --dp-shard)"),
])
def test_what_train_py_cannot_run_is_refused(p, changes, message):
    with pytest.raises(render.Unrunnable) as refused:
        render.command(p.Layout(**changes), 8, catalog.model(p, "gpt-check"), 16, 8, "float32")
    assert str(refused.value) == message


def test_llama_and_float8_are_refused(p):
    with pytest.raises(render.Unrunnable, match="^train.py trains its own GPT only"):
        render.model_options(catalog.model(p, "llama3-8b"), 8192, 16, "bf16")
    with pytest.raises(render.Unrunnable, match="^train.py computes in float32, float64, bf16, not float8$"):
        render.model_options(catalog.model(p, "gpt"), 64, 8, "float8")


def test_partial_nodes_are_refused(p):
    with pytest.raises(render.Unrunnable, match="^12 GPUs do not fill whole nodes of 8$"):
        render.nodes(12, 8)
    assert render.nodes(16, 8) == 2 and render.nodes(4, 8) == 1


def test_the_printed_command_is_accepted_by_train_py(capsys, tmp_path):
    from ddpguide.plan.__main__ import main

    assert main(["--model", "gpt", "--dim", "128", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "H100",
                 "--seq", "256", "--global-batch", "32", "--dtype", "float32", "--top", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torchrun")]
    assert len(lines) == 2
    results = parsed(lines, tmp_path)
    assert all(r["ok"] and r["world"] == 16 for r in results), results
    assert {(r["seq"], r["batch"], r["dim"], r["dtype"], r["bf16"]) for r in results} == {
        (256, 32, 128, "float32", False)}


def test_the_divisibility_rules_are_train_pys(p):
    """search.divides says yes exactly where gpt/parallelize.py's problems() finds nothing wrong
    with the model's split (the batch and the experts-with-tp rule aside: both are checked where
    the layouts are listed)."""
    from ddpguide.launch.programs import load

    par, gpt = load("gpt/parallelize.py"), load("gpt/model.py")
    checked = 0
    for shape in ({}, {"kv_heads": 2}, {"experts": 4, "top_k": 2}, {"layers": 3}):
        model = catalog.model(p, "gpt-check", **shape)
        config = gpt.Config(dim=model.dim, heads=model.heads, kv_heads=model.kv_heads or model.heads,
                            layers=model.layers, seq=12, ffn=model.ffn // model.dim, experts=model.experts,
                            top_k=model.top_k)
        for parts in search.factorizations(8, len(p.AXES)):
            axes = dict(zip(p.AXES, parts))
            found = [x for x in par.problems(par.Layout(*parts), config, 8, 1, 8 * 8)
                     if "--tp with --experts" not in x]
            assert search.divides(model, axes, 12) == (not found), (shape, axes, found)
            checked += 1
    assert checked == 4 * 56
