"""The checks every command shares: number ranges, output files, one-line errors, whole writes."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from ddpguide.core.commands import (
    InputError,
    OneLineParser,
    check_output_file,
    integer,
    json_with_keys,
    positive_float,
    write_atomically,
)
from tests.file_snapshot import snapshot


@pytest.mark.parametrize("parse, text, message", [
    (integer(1), "0", "must be >= 1, got 0"),
    (integer(1, 4), "5", "must be <= 4, got 5"),
    (integer(0), "2.0", "expected an integer, got '2.0'"),
    (positive_float(), "-1", "must be > 0, got -1"),
    (positive_float(), "nan", "must be > 0, got nan"),
    (positive_float(), "inf", "must be finite, got inf"),
    (positive_float(10), "10.5", "must be <= 10, got 10.5"),
    (positive_float(), "ten", "expected a number, got 'ten'"),
])
def test_number_types_name_the_range_and_the_value(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as info:
        parse(text)
    assert str(info.value) == message


def test_number_types_accept_their_range():
    assert integer(1, 4)("4") == 4 and integer(0)("0") == 0
    assert positive_float(10)("10") == 10.0 and positive_float()("1e-9") == 1e-9


def test_a_parser_error_is_one_line_with_exit_status_2(capsys):
    parser = OneLineParser(prog="prog")
    parser.add_argument("--n", type=integer(1))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--n", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "prog: error: argument --n: must be >= 1, got 0 (see --help)\n"


@pytest.fixture
def place(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "ours.json").write_text(json.dumps({"suite": "s", "ratios": {}}))
    (tmp_path / "ours_list.json").write_text(json.dumps([{"suite": "s", "ratios": {}}]))
    (tmp_path / "theirs.json").write_text(json.dumps({"name": "something else"}))
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "keep.pt").write_bytes(b"weights")
    os.symlink(tmp_path / "keep.pt", tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo")
    return tmp_path


def test_bad_output_files_are_refused_and_nothing_is_created(place):
    ours = json_with_keys(["suite", "ratios"])
    t = place
    for path, message in [
        ("", "--out: empty file name"),
        (t / "dir", f"--out: {t}/dir is a directory"),
        (t / "fifo", f"--out: {t}/fifo is not a regular file"),
        (t / "file" / "out.json", f"--out: {t}/file is not a directory"),
        (t / "file" / "a" / "b" / "out.json", f"--out: {t}/file is not a directory"),
        (t / "keep.pt", f"--out: {t}/keep.pt is the weights"),
        (t / "link.json", f"--out: {t}/link.json is the weights"),
        (t / "theirs.json", f"--out: {t}/theirs.json exists and is not a report; refusing to "
                            "overwrite it"),
    ]:
        before = snapshot(t)
        with pytest.raises(InputError) as info:
            check_output_file(path, "--out", protected=[(t / "keep.pt", "the weights")],
                              may_replace=ours, replaceable="a report")
        assert (str(info.value), info.value.option) == (f"argument {message}", "--out")
        assert snapshot(t) == before


def test_good_output_files_pass_and_nothing_is_created(place):
    ours = json_with_keys(["suite", "ratios"])
    before = snapshot(place)
    for name in ("new.json", "new/deeper/out.json", "ours.json", "ours_list.json", "empty.json"):
        assert check_output_file(place / name, "--out", may_replace=ours) == place / name
    assert snapshot(place) == before


def test_an_atomic_write_makes_its_folders_and_leaves_no_partial_file(tmp_path):
    write_atomically(tmp_path / "a" / "b.json", "{}\n")
    write_atomically(tmp_path / "a" / "b.json", "[]\n")
    assert (tmp_path / "a" / "b.json").read_text() == "[]\n"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]
