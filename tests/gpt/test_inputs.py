"""Bad input to book/programs/gpt/train.py: one line, exit status 2, before any process
group, and nothing written (the --out folder is never created)."""

from __future__ import annotations

import pytest

from ddpguide.launch.programs import run

PROGRAM = "gpt/train.py"


def refused(tmp_path, *args, world=None):
    env = {"WORLD_SIZE": str(world)} if world else None
    done = run(PROGRAM, *args, "--out", str(tmp_path / "out"), expect=2, echo=False, env=env,
               workdir=tmp_path / "program")
    assert not (tmp_path / "out").exists()
    lines = done.program_lines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("args, world, message", [
    (("--tp", "2"), None, "the layout TP 2 needs 2 ranks, not 1"),
    (("--tp", "8", "--heads", "4", "--dim", "64"), 8, "--tp 8 does not divide the 4 heads"),
    (("--pp", "3", "--layers", "4"), 3, "--pp 3 does not divide the 4 layers"),
    (("--cp", "3", "--seq", "64"), 3, "--cp 3 x --tp 1 does not divide the sequence of 64 tokens"),
    (("--ep", "2"), 2, "--ep 2 needs experts (--experts)"),
    (("--dp-shard", "3"), 3, "--batch 8 does not split into 3 data-parallel ranks x 1 micro-batches"),
    (("--dim", "30", "--heads", "4"), None, "--dim 30: must split into 4 heads of an even width"),
    (("--kv-heads", "3"), None, "--kv-heads 3: must divide the 4 heads"),
    (("--bf16", "--dtype", "float64"), None,
     "--bf16 with --dtype float64: the parameters bfloat16 is cast from are float32"),
    (("--tp", "2", "--kv-heads", "1"), 2, "--tp 2 does not divide the 1 key/value heads"),
    (("--cp", "4", "--seq", "36"), 4, "--cp 4: the zig-zag split needs 2 x 4 chunks of equal length, "
                                      "not of a sequence of 36 tokens"),
    (("--steps", "0"), None, "--steps 0: must be at least 1"),
    (("--rate-window", "0.5"), None, "--rate-window 0.5: more than 0 and at most 60 (seconds), with --cost"),
    (("--cost", "--rate-window", "-1"), None, "--rate-window -1: more than 0 and at most 60 (seconds), with --cost"),
])
@pytest.mark.multiprocess
def test_bad_layouts_and_widths_get_one_line(tmp_path, args, world, message):
    assert refused(tmp_path, *args, world=world) == f"train.py: {message}"


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_model_is_refused_and_none_is_replaced(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    run(PROGRAM, "--dim", "32", "--layers", "2", "--seq", "16", "--steps", "1",
        "--save", str(checkpoint), echo=False, workdir=tmp_path / "first")
    def files():
        return {str(p): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}

    before = files()
    line = refused(tmp_path, "--dim", "64", "--layers", "2", "--seq", "16", "--load", str(checkpoint))
    assert line == (f"train.py: --load {checkpoint}/step-000001: a checkpoint of another model: "
                    "dim 32 (not 64)")
    line = refused(tmp_path, "--dim", "32", "--layers", "2", "--seq", "16", "--steps", "2",
                   "--save", str(checkpoint))
    assert line == (f"train.py: --save {checkpoint}: it holds checkpoints already; resume with "
                    f"--load {checkpoint}, or save elsewhere (this program never replaces one)")
    line = refused(tmp_path, "--load", str(tmp_path))
    assert line == f"train.py: --load {tmp_path}: no complete checkpoint there"
    assert files() == before


@pytest.mark.multiprocess
def test_a_report_into_a_missing_folder_gets_one_line(tmp_path):
    missing = tmp_path / "missing" / "report.json"
    assert refused(tmp_path, "--report", str(missing)) == (
        f"train.py: --report {missing}: no folder {missing.parent}")
    assert not missing.parent.exists()
