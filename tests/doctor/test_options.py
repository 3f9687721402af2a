"""The doctor's options: every bad value is one line and exit status 2, before anything starts."""

from __future__ import annotations

import pytest

from ddpguide.doctor.options import (
    DEFAULT_SIZES,
    Options,
    UsageError,
    format_size,
    parse_options,
    parse_size,
)
from tests.doctor.doctor_runs import doctor


def test_sizes_parse_with_binary_units():
    assert parse_size("4K") == 4096
    assert parse_size("16MiB") == 16 * 2 ** 20
    assert parse_size("1024") == 1024
    assert format_size(4096) == "4 KiB" and format_size(16 * 2 ** 20) == "16 MiB" and format_size(12) == "12 B"
    assert DEFAULT_SIZES[0] == 4096 and DEFAULT_SIZES[-1] == 16 * 2 ** 20
    # nccl-tests' busbw plateaus at hundreds of MiB: on GPUs the default sweep reaches 1 GiB
    assert Options().sizes_for("cuda")[-1] == 2 ** 30 and Options().sizes_for("cpu") == DEFAULT_SIZES
    assert Options(sizes=(4096,)).sizes_for("cuda") == (4096,)


def test_defaults_and_valid_options(tmp_path):
    assert parse_options([], {}) == Options()
    options = parse_options(["--timeout", "7.5", "--sizes", "4K,1M", "--nproc", "4",
                             "--json", str(tmp_path / "r.json")], {})
    assert options == Options(7.5, (4096, 2 ** 20), 4, tmp_path / "r.json")
    assert parse_options(["--sizes", "none"], {}).sizes == ()
    assert Options().rank_argv() == ["--timeout", "30"]  # each rank picks its device's default
    assert options.rank_argv() == ["--timeout", "7.5", "--sizes", "4096,1048576",
                                   "--json", str(tmp_path / "r.json")]


@pytest.mark.parametrize("argv, environ, message", [
    (["--timeout", "0"], {}, "--timeout '0': must be more than 0 and at most 3600 seconds"),
    (["--timeout", "soon"], {}, "--timeout 'soon': not a number of seconds"),
    (["--sizes", "4K,3"], {}, "--sizes '4K,3': 3 must be a multiple of 4 bytes (float32) between 4 B and 1 GiB"),
    (["--sizes", "big"], {}, "--sizes 'big': not a size: 'big' (examples: 4096, 4K, 16M)"),
    (["--nproc", "0"], {}, "--nproc '0': must be a whole number from 1 to 64"),
    (["--nproc", "2"], {"RANK": "0"}, "--nproc '2': a launcher started this process (RANK=0); "
                                      "the launcher decides the number of ranks"),
    (["--json", "/no/such/folder/r.json"], {},
     "--json '/no/such/folder/r.json': folder '/no/such/folder' does not exist"),
    (["--colour"], {}, "unrecognized arguments: --colour"),
])
def test_bad_options_are_one_line(argv, environ, message):
    with pytest.raises(UsageError) as caught:
        parse_options(argv, environ)
    assert str(caught.value) == message


def test_json_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(UsageError, match="is a directory, not a file"):
        parse_options(["--json", str(tmp_path)], {})


@pytest.mark.parametrize("args, message", [
    (["--timeout", "-1"], "--timeout '-1': must be more than 0 and at most 3600 seconds"),
    (["--nproc", "many"], "--nproc 'many': must be a whole number from 1 to 64"),
    (["--sizes", "0"], "--sizes '0': 0 must be a multiple of 4 bytes (float32) between 4 B and 1 GiB"),
])
def test_command_line_exits_2_and_writes_nothing(tmp_path, args, message):
    report = tmp_path / "report.json"
    done = doctor([*args, "--json", str(report)], timeout_s=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == f"python -m ddpguide.doctor: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_options(tmp_path):
    options = parse_options(["--checkpoint-dir", str(tmp_path), "--checkpoint-size", "40G"], {})
    assert (options.checkpoint_dir, options.checkpoint_bytes) == (tmp_path, 40 * 2 ** 30)
    assert options.rank_argv()[-4:] == ["--checkpoint-dir", str(tmp_path),
                                        "--checkpoint-size", str(40 * 2 ** 30)]
    for argv, message in (
        (["--checkpoint-dir", str(tmp_path / "nope")], f"--checkpoint-dir {str(tmp_path / 'nope')!r}: not a directory"),
        (["--checkpoint-size", "1G"], "--checkpoint-size needs --checkpoint-dir"),
    ):
        with pytest.raises(UsageError) as caught:
            parse_options(argv, {})
        assert str(caught.value) == message
