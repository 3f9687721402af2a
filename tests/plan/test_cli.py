"""``python -m ddpguide.plan``: bad input is one line and exit 2; the table, the command, --json."""

from __future__ import annotations

import json

import pytest

from ddpguide.plan.__main__ import main


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "--model nope: not one of gpt,"),
    (["--gpus", "0"], "--gpus 0: must be at least 1"),
    (["--hardware", "Z80"], "--hardware Z80: not one of H100,"),
    (["--hardware", "missing.json"], "--hardware missing.json: no such file"),
    (["--dtype", "int4"], "--dtype int4: not one of float32,"),
    (["--dim", "65"], "--dim 65: does not split into 4 heads"),
    (["--gpus", "3", "--global-batch", "8", "--model", "gpt-check"], "no layout of --model gpt-check divides 3"),
    (["--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
    (["--link", "1gbit"], "--link 1gbit: only with --hardware cluster"),
    (["--hardware", "cluster", "--gpus", "3"], "--gpus 3: with --hardware cluster, 2 to 8 nodes"),
    (["--hardware", "cluster", "--link", "5tbit"], "'5tbit' is not a rate such as 1gbit"),
    (["--headroom", "0.5"], "--headroom 0.5: between 1 and 4 (times the predicted peak)"),
    (["--gpus", "12", "--hardware", "h100"], "--gpus 12: does not fill whole nodes of 8 GPUs (--gpus-per-node 8); "
                                             "plan a multiple of 8"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        raise SystemExit(main(argv))
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_table_and_command(capsys):
    assert main(["--model", "llama3-8b", "--gpus", "8", "--hardware", "h100", "--seq", "8192",
                 "--global-batch", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "tokens/s a GPU" in out
    assert "the capstone's train.py cannot run it: train.py trains its own GPT only" in out
    assert main(["--model", "gpt", "--gpus", "16", "--gpus-per-node", "8", "--hardware", "H100",
                 "--global-batch", "16", "--top", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torchrun")]
    assert [line.split(" --nproc-per-node")[0] for line in lines] == [
        "torchrun --nnodes 2 --node-rank 0", "torchrun --nnodes 2 --node-rank 1"]
    assert all(line.endswith("--layers 4 --dim 64 --heads 4 --ffn 4 --seq 4096 --batch 16 --dtype float32 --bf16")
               for line in lines)


@pytest.mark.parametrize("text, message", [
    ("{nope", "not JSON (Expecting property name enclosed in double quotes, line 1 column 2)"),
    ("[1, 2]", "not a JSON object of plan_cost.Hardware's fields"),
    ('{"peak": 1e12, "wings": 2}', "no such field of plan_cost.Hardware: wings"),
    ('{"peak": "fast"}', 'peak is "fast", not a number'),
    ('{"links": [1, 2]}', "links is [1, 2], not an object"),
])
def test_bad_hardware_file_one_line_nothing_written(text, message, capsys, tmp_path, monkeypatch):
    bad = tmp_path / "hw.json"
    bad.write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["--hardware", str(bad)]) == 2
    assert capsys.readouterr().err == f"python -m ddpguide.plan: --hardware {bad}: {message}\n"
    assert list(tmp_path.iterdir()) == [bad] and bad.read_text() == text


def test_json_every_layout(capsys):
    assert main(["--model", "gpt-check", "--gpus", "4", "--hardware", "A100", "--seq", "16",
                 "--dtype", "float32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) > 10 and all(r["fits"] for r in rows)
    steps = [r["step"]["total"] for r in rows]
    assert steps == sorted(steps)
