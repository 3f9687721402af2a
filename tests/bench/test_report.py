"""The report every suite returns: its table, its JSON, and the JSON read back."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddpguide.bench.appendix import ratio_rows
from ddpguide.bench.report import REPORT_KEYS, Report, check_report_file, machine_info
from ddpguide.core.commands import InputError


def _report() -> Report:
    report = Report("ddp", machine={"cpu_count": 2})
    report.add("1 rank", 12.5, "ms/step", batch=64)
    report.add("2 ranks", 8, "ms/step")
    report.ratios["ddp2_speedup"] = 1.5625
    report.notes.append("measured on a quiet machine")
    return report


def test_measurements_are_floats_and_found_by_name():
    report = _report()
    assert report.get("2 ranks").value == 8.0 and isinstance(report.get("2 ranks").value, float)
    assert report.get("1 rank").details == {"batch": 64}
    with pytest.raises(KeyError):
        report.get("3 ranks")


def test_the_table_lists_measurements_ratios_and_notes():
    assert _report().table().splitlines() == [
        "suite: ddp",
        "-" * 36,
        "1 rank" + " " * 16 + "12.5 ms/step",
        "2 ranks" + " " * 18 + "8 ms/step",
        "-" * 36,
        "ddp2_speedup" + " " * 9 + "1.562",
        "measured on a quiet machine",
    ]


def test_the_json_reads_back_to_the_same_report(tmp_path):
    path = tmp_path / "out" / "ddp.json"
    _report().write_json(path)
    data = json.loads(path.read_text())
    provenance = ("measured_at", "command", "load_at_start", "load_at_end")
    assert all(data[k] is not None for k in provenance)  # written when the suite is done
    assert {k: v for k, v in data.items() if k not in provenance} == {
        "suite": "ddp", "machine": {"cpu_count": 2},
        "measurements": [{"name": "1 rank", "value": 12.5, "unit": "ms/step",
                          "details": {"batch": 64}},
                         {"name": "2 ranks", "value": 8.0, "unit": "ms/step", "details": {}}],
        "ratios": {"ddp2_speedup": 1.5625}, "spreads": {}, "notes": ["measured on a quiet machine"]}
    assert set(REPORT_KEYS) <= data.keys()
    # what the appendix reads from it: each ratio beside its anchor
    [(name, value, anchor)] = ratio_rows(data)
    assert (name, value) == ("ddp2_speedup", 1.5625)
    assert anchor.meaning == "2 ranks / DDP on 1 rank, throughput, ConvNet, interleaved"
    # a report may be replaced by the next run; another JSON file may not
    assert check_report_file(path, "--json") == path
    (tmp_path / "other.json").write_text('{"suite": "ddp"}')
    with pytest.raises(InputError, match="exists and is not a benchmark report"):
        check_report_file(tmp_path / "other.json", "--json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["ddp.json"]  # no partial file left


def test_the_machine_is_described():
    info = machine_info()
    assert info["cpu_count"] == os.cpu_count() and info["torch"] == torch.__version__
    assert info["cuda_available"] == torch.cuda.is_available()
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert Report("x").machine.keys() == info.keys()
