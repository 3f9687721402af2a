"""`book/programs/zero3_by_hand.py` is safe to copy: what a reader does next works or is refused.

Each case is a script of its own (the program sets float64 as the default dtype when
imported), run with the suite's runner: the first as typed, the others forked from the
warm server. It imports the program by path, joins a one-rank gloo group, where the hooks
free and refill the parameters' storage exactly as on more ranks, and prints one JSON line.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.programs.programs_support import PYTHON, check_ok, run

PROGRAM = Path(__file__).resolve().parents[2] / "book" / "programs" / "zero3_by_hand.py"

SETUP = f"""
import datetime, importlib.util, json, sys
import torch, torch.distributed as dist
from torch import nn
spec = importlib.util.spec_from_file_location("zero3_by_hand", {str(PROGRAM)!r})
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
def refusal(make):
    try:
        program.shard_model(make(), 0, 1)
    except (ValueError, TypeError) as exc:
        return [type(exc).__name__, str(exc)]
    return None
"""


def run_case(folder: Path, body: str) -> dict:
    (folder / "case.py").write_text(SETUP + textwrap.dedent(body) + "\ndist.destroy_process_group()\n")
    done = check_ok(run([PYTHON, "case.py"], folder, timeout=120))
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_the_gather_buffer_keeps_the_parameter_dtype(tmp_path):
    out = run_case(tmp_path, """
        model = nn.Sequential(nn.Linear(4, 3, dtype=torch.bfloat16), nn.Linear(3, 2, dtype=torch.float32))
        program.shard_model(model, 0, 1)
        dtypes = [str(p.dtype) for p in model.parameters()]
        print(json.dumps({"dtypes": dtypes}))
    """)
    assert out["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]


@pytest.mark.timeout(180)
def test_gradients_accumulate_over_micro_batches(tmp_path):
    out = run_case(tmp_path, """
        model = program.make_model()
        plain = program.make_model()
        shards = program.shard_model(model, 0, 1)
        x = torch.randn(8, 6)
        for half in (x[:4], x[4:]):
            model(half).sum().backward()
            plain(half).sum().backward()
        expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        got = torch.cat([s.shard.grad[: s.numel] for s in shards])
        print(json.dumps({"difference": (got - expected).abs().max().item()}))
    """)
    assert out["difference"] <= 1e-12


@pytest.mark.timeout(180)
def test_a_forward_under_no_grad_runs(tmp_path):
    out = run_case(tmp_path, """
        model = program.make_model()
        plain = program.make_model()
        program.shard_model(model, 0, 1)
        x = torch.randn(5, 6)
        with torch.no_grad():
            difference = (model(x) - plain(x)).abs().max().item()
        model(x).sum().backward()  # and training still works afterwards
        print(json.dumps({"difference": difference}))
    """)
    assert out["difference"] <= 1e-12


@pytest.mark.timeout(180)
def test_what_it_cannot_shard_is_refused_in_one_line(tmp_path):
    out = run_case(tmp_path, """
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.out = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
                self.out.weight = self.embed.weight
            def forward(self, tokens):
                return self.out(self.embed(tokens))
        class Pair(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(4, 4))
            def forward(self, x):
                return x @ self.weight, x
        def pair_forward():
            model = Pair()
            program.shard_model(model, 0, 1)
            try:
                model(torch.randn(2, 4))
            except TypeError as exc:
                return [type(exc).__name__, str(exc)]
        print(json.dumps({"tied": refusal(Tied),
                          "attention": refusal(lambda: nn.MultiheadAttention(8, 2)),
                          "tuple": pair_forward()}))
    """)
    assert out["tied"] == ["ValueError", "out.weight is the same tensor as embed.weight (tied weights): "
                           "shard_model shards each layer's own parameters and cannot share one"]
    assert out["attention"] == ["ValueError", "the model (MultiheadAttention) owns parameters and so does "
                                "its part out_proj: shard_model hooks layers without such parts"]
    assert out["tuple"] == ["TypeError", "Pair returned tuple: shard_model hooks layers that return one tensor"]


@pytest.mark.timeout(180)
def test_a_layer_whose_part_has_no_parameters_is_sharded(tmp_path):
    """LayerNorm(elementwise_affine=False) registers weight=None: a part with no parameter."""
    out = run_case(tmp_path, """
        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.full((6,), 2.0))
                self.norm = nn.LayerNorm(6, elementwise_affine=False)
            def forward(self, x):
                return self.norm(x) * self.scale
        model, plain = Scaled(), Scaled()
        shards = program.shard_model(model, 0, 1)
        x = torch.randn(4, 6)
        model(x).sum().backward()
        plain(x).sum().backward()
        print(json.dumps({"shards": len(shards),
                          "difference": (shards[0].shard.grad[:6] - plain.scale.grad).abs().max().item()}))
    """)
    assert out["shards"] == 1
    assert out["difference"] <= 1e-12
