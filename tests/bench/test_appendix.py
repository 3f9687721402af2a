"""The appendix shows saved full runs: each with its provenance, a missing one said so."""

from __future__ import annotations

import json

from ddpguide.bench.appendix import load_results, provenance, ratio_rows
from ddpguide.bench.report import Report


def test_saved_reports_load_by_suite_and_a_missing_one_is_none(tmp_path):
    report = Report("ddp", ratios={"ddp1_over_plain": 1.01})
    (tmp_path / "ddp.json").write_text(json.dumps(report.to_dict()))
    results = load_results(tmp_path, suites=("ddp", "amp"))
    assert results["amp"] is None
    assert results["ddp"]["ratios"] == {"ddp1_over_plain": 1.01}
    assert [(name, value) for name, value, _ in ratio_rows(results["ddp"])] == [
        ("ddp1_over_plain", 1.01)]


def test_provenance_names_date_machine_command_and_load():
    report = Report("amp").to_dict()
    report.update(measured_at="2026-12-01T05:00:00+00:00", command="python -m ddpguide.bench amp",
                  load_at_start=0.5, load_at_end=0.75)
    report["machine"].update(cpu_model="Some CPU", cpu_count=2, gpus=[], torch="2.14.1")
    assert provenance(report) == (
        "Measured 2026-12-01T05:00:00+00:00 on Some CPU, 2 cores, no GPU, torch 2.14.1, "
        "with `python -m ddpguide.bench amp`; load average 0.50 at the start, 0.75 at the end.")


def test_a_suite_not_measured_yet_says_how_to_measure_it():
    assert provenance(None, "pipeline") == (
        "Not measured yet: run `python -m ddpguide.bench pipeline --json "
        "book/measurements/pipeline.json` (or `make bench`).")
