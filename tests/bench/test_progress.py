"""ddpguide.bench.progress: the bar, figures as they come, worker ticks, and Ctrl-C."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ddpguide.bench import progress
from ddpguide.bench.report import Report


def test_cases_move_the_bar_and_each_figure_is_printed_when_added():
    report, err, out = Report("fake"), io.StringIO(), io.StringIO()
    seen_during = []
    with progress.tracked(report, total=3, stream=err, out=out) as p:
        for case in p.cases(["a", "b", "c"]):
            report.add(f"{case} step", 1.5, "ms")
            seen_during.append(err.getvalue())  # printed before the suite goes on
    assert "  a step: 1.5 ms" in seen_during[0] and "b step" not in seen_during[0]
    assert p.done == 3 and "3/3" in err.getvalue()
    assert out.getvalue() == ""  # stdout stays for the suite's table
    assert report.on_add is None and progress.CHANNEL_VARIABLE not in os.environ


def _worker(case: str) -> None:
    progress.tick(case, figures=[(f"{case} time", 2.0, "s")])


def test_worker_processes_report_through_the_inherited_channel():
    report, err = Report("fake"), io.StringIO()
    with progress.tracked(report, total=2, stream=err, out=io.StringIO()) as p:
        context = multiprocessing.get_context("spawn")
        for case in ("x", "y"):
            worker = context.Process(target=_worker, args=(case,))
            worker.start()
            worker.join(60)
            assert worker.exitcode == 0
    assert p.done == 2
    assert [(m.name, m.value, m.unit) for m in p.figures] == [("x time", 2.0, "s"),
                                                                    ("y time", 2.0, "s")]
    assert "  x time: 2 s" in err.getvalue() and "  y time: 2 s" in err.getvalue()


def test_tick_outside_a_tracked_block_does_nothing(monkeypatch, tmp_path, capfd):
    channel = tmp_path / "channel"
    channel.write_text("")
    monkeypatch.setenv(progress.CHANNEL_VARIABLE, str(channel))  # inside: one line per tick
    progress.tick("inside", figures=[("f", 1.0, "s")])
    assert channel.read_text() == '{"case": "inside", "figures": [["f", 1.0, "s"]]}\n'
    opened = []

    class Watched:  # the module's os, with every os.open recorded
        def __getattr__(self, name):
            return getattr(os, name)

        def open(self, *args, **kwargs):
            opened.append(args)
            return os.open(*args, **kwargs)

    monkeypatch.setattr(progress, "os", Watched())
    monkeypatch.delenv(progress.CHANNEL_VARIABLE)
    monkeypatch.chdir(tmp_path)
    progress.tick("nothing", figures=[("f", 1.0, "s")])  # no channel: nothing opened or printed
    assert opened == [] and capfd.readouterr() == ("", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["channel"]
    assert channel.read_text().count("\n") == 1


def test_an_interrupt_prints_what_was_measured_and_propagates():
    report, out = Report("fake"), io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with progress.tracked(report, total=4, stream=io.StringIO(), out=out) as p:
            for case in p.cases(["a", "b", "c", "d"]):
                report.add(f"{case} step", 3.0, "ms")
                if case == "b":
                    raise KeyboardInterrupt
    text = out.getvalue()
    assert text.startswith("interrupted after 1 of 4 cases; measured so far:\nsuite: fake")
    assert "a step" in text and "b step" in text and "c step" not in text


FAKE_SUITE = textwrap.dedent("""
    import sys, time
    from ddpguide.bench import __main__ as bench, progress
    from ddpguide.bench.report import Report

    def run(quick):
        report = Report("fake")
        with progress.tracked(report, total=3) as p:
            for case in p.cases(["first", "second", "third"]):
                if case == "third":
                    print("waiting", file=sys.stderr, flush=True)
                    time.sleep(60)  # Ctrl-C arrives here
                report.add(f"{case} step", 7.0, "ms")
        return report

    class Fake:
        pass
    fake = Fake()
    fake.run = run
    bench.load_suite = lambda name: fake
    sys.exit(bench.main(["ddp"]))
""")


@pytest.mark.timeout(120)
def test_ctrl_c_on_the_command_line_prints_the_partial_table_and_exits_130(tmp_path):
    script = tmp_path / "fake_suite.py"
    script.write_text(FAKE_SUITE)
    # As a terminal's foreground job: SIGINT at its default. A shell without job control
    # starts background commands with SIGINT ignored, and Python then installs no handler.
    process = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        err = ""
        while "waiting" not in err:  # read stderr until the suite sits in its third case
            line = process.stderr.readline()
            assert line or process.poll() is None, err
            err += line
            assert time.monotonic() < deadline, err
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        out, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    err += rest
    assert process.returncode == 130, (out, err)
    assert out.startswith("interrupted after 2 of 3 cases; measured so far:\nsuite: fake")
    assert "first step" in out and "second step" in out
    assert "  first step: 7 ms" in err  # printed when measured, before the interrupt
    assert "python -m ddpguide.bench ddp: interrupted" in err
    assert "Traceback" not in err
