"""The appendix shows saved full runs: each with its provenance, a missing one said so."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_json_file_written_in_a_temporary_folder_is_shown_as_file():
    report = Report("gpt").to_dict()
    report.update(measured_at="2026-12-01T05:00:00+00:00",
                  command="python -m ddpguide.bench gpt --json /tmp/meas_gpt.json", load_at_start=None)
    report["machine"].update(cpu_model="Some CPU", cpu_count=2, gpus=[], torch="2.14.1")
    assert provenance(report) == (
        "Measured 2026-12-01T05:00:00+00:00 on Some CPU, 2 cores, no GPU, torch 2.14.1, "
        "with `python -m ddpguide.bench gpt --json FILE` (FILE then kept as `book/measurements/gpt.json`).")
    report["command"] = "python -m ddpguide.bench gpt --json book/measurements/gpt.json"
    assert provenance(report).endswith("with `python -m ddpguide.bench gpt --json book/measurements/gpt.json`.")


def test_a_suite_not_measured_yet_says_how_to_measure_it():
    assert provenance(None, "pipeline") == (
        "Not measured yet: run `python -m ddpguide.bench pipeline --json "
        "book/measurements/pipeline.json` (or `make bench`).")


def test_the_pipeline_sweep_is_drawn_from_a_saved_report_or_said_missing(capsys):
    import matplotlib

    matplotlib.use("Agg")
    from ddpguide.bench.appendix import pipeline_sweep

    assert pipeline_sweep(None) is None
    assert capsys.readouterr().out == "No saved split-size sweep to draw.\n"
    report = Report("pipeline")
    report.add("1 process x 1 thread, whole model", 2000.0, "ms/step", case="c", kind="single",
               seconds=2.0, low=1.9, high=2.2)
    for size, seconds in ((20, 1.4), (60, 1.9)):
        report.add(f"pipeline {size}", seconds * 1e3, "ms/step", case="c", schedule="1f1b",
                   split_size=size, split_point="layer3.0", seconds=seconds, low=seconds - 0.1,
                   high=seconds + 0.2)
    fig = pipeline_sweep(json.loads(json.dumps(report.to_dict())))
    line = fig.axes[0].containers[0].lines[0]
    assert list(line.get_xdata()) == [20, 60] and list(line.get_ydata()) == [1.4, 1.9]


def test_the_summary_draws_a_family_of_per_case_ratios_as_one_bar():
    """The planner's per-layout ratios ("kind: case") are one bar each kind: their median, with
    a line over their range; a ratio of its own keeps its bar and its spread over rounds."""
    import matplotlib

    matplotlib.use("Agg")
    from ddpguide.bench.summary import summary_bars, summary_figure

    ratios = {f"step_predicted_over_measured: layout {i}": 1.0 + i / 100 for i in range(50)}
    ratios.update(rank_correlation=0.9, join_s=4.0)
    report = {"suite": "plan", "ratios": ratios, "spreads": {"join_s": {"min": 3.0, "max": 6.0, "n": 3}}}
    assert summary_bars("plan", report) == [
        ("step_predicted_over_measured", "plan: step_predicted_over_measured (median of 50 cases)",
         1.245, 1.245 - 1.0, 1.49 - 1.245),
        ("rank_correlation", "plan: rank_correlation", 0.9, 0.0, 0.0),
        ("join_s", "plan: join_s", 4.0, 1.0, 2.0)]
    fig = summary_figure({"plan": report})
    assert [len(ax.patches) for ax in fig.axes] == [2, 1]  # bars: 2 ratios, 1 in seconds


def test_the_appendix_has_a_section_for_every_suite():
    """Each suite of ddpguide.bench.SUITES is shown (show("<suite>")) and listed in the command."""
    from ddpguide.bench import SUITES

    cells = [''.join(c["source"]) for c in json.loads(
        (Path(__file__).parents[2] / "book" / "appendix_measurements.ipynb").read_text())["cells"]]
    shown = [suite for suite in SUITES if any(f'show("{suite}")' in cell for cell in cells)]
    listed = cells[0].split("# also: ")[1].split("\n")[0]
    assert shown == list(SUITES)
    assert [suite for suite in SUITES if suite in listed.split(", ")] == [s for s in SUITES if s != "ddp"]
