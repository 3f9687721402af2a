"""The shape every benchmark suite reports: measurements, ratios, the machine."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddpguide.core.commands import OneLineParser, check_output_file, json_with_keys, write_atomically

#: What every report has (``Report.to_dict``): a file with these may be replaced by a new one.
REPORT_KEYS = ("suite", "measurements", "ratios")


def invocation() -> str:
    """The command line this process runs, as a reader would type it."""
    if sys.argv and sys.argv[0].endswith(os.path.join("ddpguide", "bench", "__main__.py")):
        return " ".join(["python -m ddpguide.bench", *sys.argv[1:]])
    return " ".join(["python", *sys.argv]) if sys.argv else "python"


def machine_info() -> dict:
    """What the numbers were measured on."""
    import torch  # here: a bad command line is refused without importing torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    with_name = Path("/proc/cpuinfo")
    if with_name.exists():
        for line in with_name.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    return info


@dataclass
class Measurement:
    """One case of a suite: a name, a value with its unit, and free-form details."""

    name: str
    value: float
    unit: str
    details: dict = field(default_factory=dict)


def spread_of(values: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of a ratio's values over rounds (``n`` of them)."""
    if not values:
        raise ValueError("spread_of needs at least one value")
    q1, _, q3 = (statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1
                 else (values[0],) * 3)
    return {"median": statistics.median(values), "q1": q1, "q3": q3,
            "min": min(values), "max": max(values), "n": len(values)}


@dataclass
class Report:
    """A suite's result: what :func:`write_json` saves and :meth:`table` prints."""

    suite: str
    measurements: list[Measurement] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    #: For ratios measured over rounds: their :func:`spread_of` (the ratio is the median).
    spreads: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    machine: dict = field(default_factory=machine_info)
    #: When and how the suite ran, and the machine's load (1-minute average) as it
    #: started: a reader can tell a quiet run from a noisy one.
    measured_at: str = field(default_factory=lambda: datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))
    command: str = field(default_factory=invocation)
    load_at_start: float = field(default_factory=lambda: round(os.getloadavg()[0], 2))
    #: Stamped by :meth:`write_json`, when the suite is done.
    load_at_end: float | None = None
    #: Called with every new measurement (``ddpguide.bench.progress`` prints it at once).
    on_add: Callable[[Measurement], None] | None = field(default=None, repr=False, compare=False)

    def add(self, name: str, value: float, unit: str, **details) -> Measurement:
        m = Measurement(name, float(value), unit, details)
        self.measurements.append(m)
        if self.on_add is not None:
            self.on_add(m)
        return m

    def add_ratio(self, name: str, values: list[float]) -> float:
        """Record a ratio measured once per round: its median, and its spread."""
        self.spreads[name] = spread_of(values)
        self.ratios[name] = self.spreads[name]["median"]
        return self.ratios[name]

    def get(self, name: str) -> Measurement:
        for m in self.measurements:
            if m.name == name:
                return m
        raise KeyError(name)

    def table(self) -> str:
        width = max([len(m.name) for m in self.measurements] + [len(k) for k in self.ratios] + [10])
        lines = [f"suite: {self.suite}", "-" * (width + 24)]
        for m in self.measurements:
            lines.append(f"{m.name:<{width}}  {m.value:>12.4g} {m.unit}")
        if self.ratios:
            lines.append("-" * (width + 24))
            for name, value in self.ratios.items():
                lines.append(f"{name:<{width}}  {value:>12.3f}{format_spread(self.spreads.get(name))}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "suite": self.suite,
            "measured_at": self.measured_at,
            "command": self.command,
            "load_at_start": self.load_at_start,
            "load_at_end": self.load_at_end,
            "machine": self.machine,
            "measurements": [asdict(m) for m in self.measurements],
            "ratios": self.ratios,
            "spreads": self.spreads,
            "notes": self.notes,
        }

    def write_json(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` to ``path``, whole or not at all (missing folders are made),
        with the machine's load now that the suite is done."""
        self.load_at_end = round(os.getloadavg()[0], 2)
        write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")


def check_report_file(path: str | os.PathLike, option: str,
                      protected: list[tuple[str, str]] | None = None) -> Path:
    """Before a suite runs: raise :class:`~ddpguide.core.commands.InputError` unless a report
    can be written at ``path`` without clobbering a file that is not a report."""
    return check_output_file(path, option, protected=protected or (),
                             may_replace=json_with_keys(REPORT_KEYS),
                             replaceable="a benchmark report")


def add_parser(prog: str, description: str, suite: str) -> OneLineParser:
    """The command line of a measurement added alone to a saved report: ``--add FILE``."""
    parser = OneLineParser(prog=prog, description=description)
    parser.add_argument("--add", metavar="FILE", required=True,
                        help=f"a saved report of the {suite} suite, to add the measurement to")
    return parser


def saved_suite(parser: OneLineParser, value: str, suite: str) -> Path:
    """``--add``'s file, when it holds a saved report of ``suite``; else the parser's one-line
    error (exit status 2, nothing written)."""
    path = Path(value)
    try:
        found = json.loads(path.read_text()).get("suite")
    except (OSError, ValueError, AttributeError):
        found = None
    if found != suite:
        parser.error(f"--add {path}: not a saved report of the {suite} suite")
    return path


def format_spread(spread: dict[str, float] | None) -> str:
    """``  IQR a-b, range c-d over n`` (empty without a spread)."""
    if not spread:
        return ""
    return (f"  IQR {spread['q1']:.3f}-{spread['q3']:.3f}, range {spread['min']:.3f}-"
            f"{spread['max']:.3f} over {spread['n']}")


# Both sides of a comparison run with the same allocator settings: glibc's default
# thresholds cause thousands of page faults per training step on CPU.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "67108864", "MALLOC_TRIM_THRESHOLD_": "268435456"}
