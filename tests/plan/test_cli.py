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
    assert main(["--model", "llama3-8b", "--gpus", "8", "--hardware", "H100", "--seq", "8192",
                 "--global-batch", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | " in out and "tokens/s a GPU" in out
    assert "torchrun --standalone --nproc-per-node 8 train.py" in out


def test_json_every_layout(capsys):
    assert main(["--model", "gpt-check", "--gpus", "4", "--hardware", "A100", "--seq", "16",
                 "--dtype", "float32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) > 10 and all(r["fits"] for r in rows)
    steps = [r["step"]["total"] for r in rows]
    assert steps == sorted(steps)
