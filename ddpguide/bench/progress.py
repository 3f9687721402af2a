"""Progress of a benchmark suite: a bar on stderr, each figure as it is measured, Ctrl-C kept.

A suite wraps its work in :func:`tracked` and counts its cases through it::

    report = Report("mysuite")
    with tracked(report, total=len(CASES)) as progress:
        for case in progress.cases(CASES, name=lambda c: c.label):
            report.add(case.label, measure(case), "ms")  # printed on stderr at once
    return report

* the bar (``tqdm``, on stderr) names the case it is on, how many remain and an estimate;
* every ``report.add`` inside the block is printed on stderr as soon as it is made, and so is
  every ``progress.figure(name, value, unit)``: the raw numbers of a suite that builds its
  report only at the end;
* Ctrl-C (``KeyboardInterrupt``) prints what was measured so far, as a table on stdout,
  and then propagates; ``python -m ddpguide.bench`` turns it into exit status 130.

Work done in spawned processes reports with :func:`tick` (``tick("fp32, round 2",
figures=[("fp32 step", 31.2, "ms")])``): the processes inherit a channel (a file named
in the environment) that the bar reads, so their cases move the bar and their figures are
printed, and kept for an interrupted run, although the suite's report is only built when
they return. Outside :func:`tracked`, :func:`tick` does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

from ddpguide.bench.report import Measurement, Report

#: The variable that tells worker processes where to report their progress.
CHANNEL_VARIABLE = "DDPGUIDE_BENCH_PROGRESS"
POLL_S = 0.2


def tick(case: str, figures: Iterable[tuple[str, float, str]] = ()) -> None:
    """One case done, in this process or a worker it started; ``figures``: (name, value, unit)."""
    path = os.environ.get(CHANNEL_VARIABLE)
    if not path:
        return
    line = json.dumps({"case": case, "figures": [[n, float(v), u] for n, v, u in figures]})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())  # one write: lines of several processes stay whole
    finally:
        os.close(fd)


def format_figure(name: str, value: float, unit: str) -> str:
    return f"  {name}: {value:.4g} {unit}"


class SuiteProgress:
    """The bar and the figures of one suite run; made by :func:`tracked`."""

    def __init__(self, report: Report, total: int, unit: str = "case",
                 stream: TextIO | None = None, out: TextIO | None = None):
        self.report, self.total, self.unit = report, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.done = 0
        #: Figures given to :meth:`figure` or by worker processes, in order: the raw numbers a
        #: suite builds its report from at the end (kept for an interrupted run).
        self.figures: list[Measurement] = []
        self.bar: Any = None  # the tqdm bar, made on entering the block
        self._channel = ""
        self._read = 0
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._lock = threading.RLock()  # advance() holds it while it calls figure()

    # -- counting --------------------------------------------------------------------------
    def advance(self, case: str, figures: Iterable[tuple[str, float, str]] = ()) -> None:
        """One case finished (``case`` names it on the bar); print its figures."""
        with self._lock:
            for name, value, unit in figures:
                self.figure(name, value, unit)
            self.done += 1
            self.bar.set_postfix_str(case, refresh=False)
            self.bar.update(1)

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        """``with progress.case("fp32"):`` the bar shows the case while it runs, then counts it."""
        self.bar.set_postfix_str(name)
        yield
        self.advance(name)

    def cases(self, items: Iterable[Any], name: Callable[[Any], str] = str) -> Iterator[Any]:
        """Every item, each counted as one case once the loop body is done with it."""
        for item in items:
            with self.case(name(item)):
                yield item

    # -- figures made in this process ------------------------------------------------------
    def figure(self, name: str, value: float, unit: str) -> None:
        """Print a raw figure now, before the report is built from it (kept if interrupted)."""
        with self._lock:
            self.figures.append(Measurement(name, float(value), unit))
            self.bar.write(format_figure(name, value, unit), file=self.stream)

    def _show(self, measurement: Measurement) -> None:
        with self._lock:
            self.bar.write(format_figure(measurement.name, measurement.value, measurement.unit),
                           file=self.stream)

    # -- figures and cases from worker processes -------------------------------------------
    def _poll(self) -> None:
        with open(self._channel, "rb") as f:
            f.seek(self._read)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self._read += len(complete)
        for line in complete.decode().splitlines():
            entry = json.loads(line)
            self.advance(entry["case"], [tuple(f) for f in entry["figures"]])

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    # -- the block -------------------------------------------------------------------------
    def __enter__(self) -> SuiteProgress:
        self.bar = tqdm(total=self.total, desc=self.report.suite, unit=self.unit,
                        file=self.stream, dynamic_ncols=True, mininterval=0.5)
        fd, self._channel = tempfile.mkstemp(prefix="ddpguide-progress-", suffix=".jsonl")
        os.close(fd)
        self._previous = os.environ.get(CHANNEL_VARIABLE)
        os.environ[CHANNEL_VARIABLE] = self._channel  # inherited by the processes it starts
        self.report.on_add = self._show
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join()
        self._poll()  # what the workers wrote last
        self.report.on_add = None
        if self._previous is None:
            os.environ.pop(CHANNEL_VARIABLE, None)
        else:
            os.environ[CHANNEL_VARIABLE] = self._previous
        os.unlink(self._channel)
        self.bar.close()
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            print(self.interrupted_table(), file=self.out, flush=True)
        # nothing is swallowed: returning None re-raises

    def interrupted_table(self) -> str:
        """What an interrupted run had measured: the report so far and the workers' figures."""
        lines = [f"interrupted after {self.done} of {self.total} {self.unit}s; measured so far:"]
        if self.report.measurements or self.report.ratios:
            lines.append(self.report.table())
        if self.figures:
            lines.append("figures measured before the report was built:")
            lines.extend(format_figure(m.name, m.value, m.unit) for m in self.figures)
        if len(lines) == 1:
            lines.append("  nothing yet")
        return "\n".join(lines)


def tracked(report: Report, total: int, unit: str = "case", stream: TextIO | None = None,
            out: TextIO | None = None) -> SuiteProgress:
    """The progress of ``report``'s suite over ``total`` cases (see the module docstring)."""
    return SuiteProgress(report, total, unit, stream, out)
