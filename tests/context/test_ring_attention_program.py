"""The ring-attention program, run as the chapter runs it (torchrun, a copy alone in a folder):
every variant equals full attention, and its counts equal the formulas."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpguide.context.program import (
    PROGRAM,
    busiest_over_mean,
    bytes_formula,
    contiguous_imbalance,
    work_per_rank,
)
from ddpguide.launch.programs import PROGRAMS, load, run, torchrun
from tests.edited_programs import edited_copy
from tests.programs.programs_support import PYTHON
from tests.programs.programs_support import run as run_in_shell
from tests.programs.report_support import assert_report_agrees, assert_report_into_missing_folder_refused

BATCH, HEADS, SEQ, HEAD_DIM = 1, 12, 48, 8  # the program's defaults
METHODS = ("ring", "zigzag", "ulysses")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_variant_equals_full_attention_and_counts_meet_the_formulas(world, tmp_path):
    launch = run("ring_attention.py", launcher=torchrun(world), timeout=300, expect=None,
                 echo=False, report=True, workdir=tmp_path)
    assert launch.returncode == 0, launch.text()
    lines = launch.program_lines()
    assert (f"{world} ranks (gloo), batch {BATCH}, {HEADS} heads, sequence {SEQ}, "
                        f"head dim {HEAD_DIM}, float64") in lines
    report = launch.report
    assert {(c["method"], c["causal"]): c["ok"] for c in report["checks"]} == {
        (m, causal): True for m in METHODS for causal in (False, True)}
    assert "all checks passed" in lines
    if world == 3:  # the report says what the program printed
        assert_report_agrees(launch)
        for method in ("ring", "zigzag"):
            blocks = report["work"][method]
            assert (f"causal work per rank, {method:6} (S/N x S/N blocks, a diagonal one counts 1/2): "
                    f"{blocks}, busiest/mean {max(blocks) * world / sum(blocks):.3f}") in lines
        for method in METHODS:
            assert f"bytes sent per rank, {method:7} forward + backward: {report['bytes'][method]}" in lines
    # work, as the program counted it while computing, against the chunking rule and formulas
    assert report["work"]["ring"] == work_per_rank(world, "contiguous") == [
        r + 0.5 for r in range(world)]
    assert busiest_over_mean(report["work"]["ring"]) == pytest.approx(contiguous_imbalance(world))
    assert report["work"]["zigzag"] == work_per_rank(world, "zigzag") == [world / 2] * world
    local = BATCH * HEADS * (SEQ // world) * HEAD_DIM * 8  # bytes of one of q, k, v per rank
    for method in METHODS:
        assert report["bytes"][method] == [bytes_formula(method, world, local)] * world


def test_without_the_mask_every_rank_does_every_block():
    assert work_per_rank(3, "contiguous", causal=False) == [3.0] * 3
    assert work_per_rank(3, "zigzag", causal=False) == [3.0] * 3


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    shutil.copy(PROGRAMS / "ring_attention.py", tmp_path / "ring_attention.py")
    return tmp_path


REFUSALS = [
    ([], {}, "start it with torchrun: torchrun --standalone --nproc-per-node=2 ring_attention.py"),
    ([], {"WORLD_SIZE": "1", "RANK": "0"},
     "--nproc-per-node=1: context parallelism splits the sequence over 2 ranks or more "
     "(use --nproc-per-node=2)"),
    (["--seq", "50"], {"WORLD_SIZE": "3", "RANK": "0"},
     "--seq 50: the zig-zag split cuts it into 2 x 3 = 6 chunks, and 50 does not divide evenly "
     "(no padding: use a multiple of 6)"),
    (["--seq", "50", "--methods", "ring"], {"WORLD_SIZE": "4", "RANK": "0"},
     "--seq 50: it is split into 4 blocks, and 50 does not divide evenly "
     "(no padding: use a multiple of 4)"),
    (["--heads", "4"], {"WORLD_SIZE": "3", "RANK": "0"},
     "--heads 4: Ulysses gives each of the 3 ranks whole heads, and 4 do not divide evenly "
     "(use a multiple of 3, or --methods ring,zigzag)"),
    (["--methods", "ring,flash"], {"WORLD_SIZE": "2", "RANK": "0"},
     "--methods ring,flash: unknown 'flash' (choose from ring, zigzag, ulysses)"),
    (["--seq", "0"], {"WORLD_SIZE": "2", "RANK": "0"}, "--seq 0: must be at least 1"),
    (["--seq", "many"], {"WORLD_SIZE": "2", "RANK": "0"},
     "argument --seq: invalid int value: 'many'"),
    (["--heads", "4"], {"WORLD_SIZE": "3", "RANK": "1"}, ""),  # only rank 0 says it
    (["--report", "/no/such/folder/r.json"], {"WORLD_SIZE": "2", "RANK": "0"},
     "--report /no/such/folder/r.json: no folder /no/such/folder"),
]


def parse_error(args, env, monkeypatch, capsys) -> str:
    """The program's argument check, in this process: it must exit 2 and print only on stderr."""
    program = load(PROGRAM)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        program.parse_args(args)
    captured = capsys.readouterr()
    assert (stopped.value.code, captured.out) == (2, "")
    return captured.err


@pytest.mark.parametrize("args, env, message", REFUSALS)
def test_bad_input_is_one_line_and_exit_2(args, env, message, monkeypatch, capsys):
    assert parse_error(args, env, monkeypatch, capsys) == (message + "\n" if message else "")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, env, message", [REFUSALS[0], REFUSALS[4]])
def test_the_program_refuses_before_any_process_group_and_writes_nothing(copy, args, env, message):
    """As a reader (or a rank that torchrun started) runs it."""
    done = run_in_shell([PYTHON, "ring_attention.py", *args], copy, timeout=150, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", message + "\n")
    assert sorted(p.name for p in copy.iterdir()) == ["ring_attention.py"]  # nothing written


def test_the_counts_follow_the_program(tmp_path):
    """An edited copy, as a reader might write it: each rank takes two neighbouring chunks
    instead of the head and the tail. The count is then the contiguous split's."""
    edited = edited_copy(PROGRAM, tmp_path, ("[rank, 2 * world - 1 - rank]", "[2 * rank, 2 * rank + 1]"))
    assert work_per_rank(4, "zigzag") == [2.0] * 4
    assert work_per_rank(4, "zigzag", program=edited) == [0.5, 1.5, 2.5, 3.5]


@pytest.mark.timeout(200)
def test_a_report_into_a_missing_folder_is_refused_before_anything_starts(copy):
    assert_report_into_missing_folder_refused("ring_attention.py", copy, {"WORLD_SIZE": "2", "RANK": "0"},
                                              "--report missing/r.json: no folder ")


def test_the_byte_formulas_with_grouped_query_attention():
    """g query heads per key/value head: k, v and their gradients are 1/g of q's size."""
    assert bytes_formula("ring", 8, 1, groups=1) == 44 and bytes_formula("ulysses", 8, 1, groups=1) == 7
    assert bytes_formula("ring", 8, 1, groups=8) == 5.5
    assert bytes_formula("ulysses", 8, 1, groups=8) == pytest.approx(4.5 * 7 / 8)
    # multi-query attention (g = H): Ulysses' share of k and v vanishes as g grows
    assert bytes_formula("ulysses", 4, 1, groups=10**9) == pytest.approx(4 * 3 / 4)
    with pytest.raises(ValueError, match="groups must be >= 1, got 0"):
        bytes_formula("ring", 2, 1, groups=0)


def bf16_errors(program, monkeypatch) -> list[float]:
    """The program's ring on bfloat16 inputs, forward and backward, in this process: a ring of
    16 ranks in which the held block never leaves (keys [k, k, ..., k], 16 copies). The softmax
    over 16 copies of a block is the softmax over the block, and the 16 shares of its
    gradients add up to the block's, so out, dq, dk and dv equal attention on (q, k, v).
    Returned: the largest difference from float64 attention on the same inputs, over the
    largest exact value, for out, dq, dk, dv."""
    import torch
    import torch.nn.functional as F

    monkeypatch.setattr(program, "dist", SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 16))
    monkeypatch.setattr(program, "ring_pass", lambda tensors, tag: (list(tensors), []))
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 64, 16, generator=generator).bfloat16() for _ in range(4))
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = program.RingAttention.apply(*mine, "contiguous", False)
    out.backward(dout)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*exact)
    expected.backward(dout.double())
    assert [t.dtype for t in (out, *(t.grad for t in mine))] == [torch.bfloat16] * 4
    return [((a.double() - b).abs().max() / b.abs().max()).item()
            for a, b in zip((out, *(t.grad for t in mine)), (expected, *(t.grad for t in exact)))]


BF16_ULP = 2.0 ** -8  # rounding a value to bfloat16 moves it by at most this times the largest value


def test_bfloat16_inputs_are_rounded_once_not_at_every_merge_and_hop(monkeypatch):
    """The running max, sum and output, and the travelling dk and dv, are float32: the results
    differ from exact attention only by their final rounding to bfloat16."""
    assert max(bf16_errors(load(PROGRAM), monkeypatch)) < BF16_ULP


def test_accumulators_in_the_input_dtype_fail_the_bfloat16_bound(tmp_path, monkeypatch):
    """The same ring with accumulators in bfloat16: each of out, dq, dk, dv is off by more."""
    edited = edited_copy(PROGRAM, tmp_path, ("return torch.promote_types(dtype, torch.float32)",
                                             "return dtype"))
    assert min(bf16_errors(load(edited), monkeypatch)) > BF16_ULP
