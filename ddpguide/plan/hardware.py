"""The hardware a prediction is made on, loaded in one place.

:func:`named` is a data sheet of :data:`catalog.HARDWARE` (its name in any case);
:func:`from_file` a JSON file that ``plan_measure.py --measure`` and ``--sweep`` wrote (or any
object of ``plan_cost.Hardware``'s fields), refused in one line when it is not one;
:func:`from_fields` the same object once read (a saved benchmark's); :func:`measured` this
machine, measured now; :func:`load` the one a ``--hardware`` option names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from ddpguide.core import scratch
from ddpguide.core.commands import InputError
from ddpguide.launch import report as reports
from ddpguide.launch.programs import torchrun
from ddpguide.launch.report import ReportError
from ddpguide.plan import catalog, search

#: what ``--hardware`` takes besides a data sheet's name and a ``.json`` file
MEASURED = ("this-machine", "cluster")


_WORDS = {int: "a number", float: "a number", str: "a string", dict: "an object", list: "a list"}


def _kind(found: dataclasses.Field) -> type:
    """The type of a field's default (its factory's, for a dict or a list)."""
    if found.default is not dataclasses.MISSING:
        return type(found.default)
    return type(found.default_factory())  # type: ignore[operator]


def canonical(name: str) -> str | None:
    """The data sheet ``name`` names, in any case (None: none does)."""
    return next((known for known in catalog.HARDWARE if known.lower() == name.lower()), None)


def named(p: ModuleType, name: str, **changes: Any) -> Any:
    """The data sheet ``name`` (any case) as a ``plan_cost.Hardware``, ``changes`` applied."""
    found = canonical(name)
    if found is None:
        raise InputError(f"--hardware {name}: not one of {', '.join((*catalog.HARDWARE, *MEASURED))} "
                         "nor a .json file")
    return p.Hardware(**{**catalog.HARDWARE[found], **changes})


def from_fields(p: ModuleType, fields: object, origin: str, known_only: bool = False) -> Any:
    """``fields`` (a JSON object) as a ``plan_cost.Hardware``; ``origin`` names it in the error.
    ``known_only``: fields the program does not have are left out (a saved record carries more)."""
    if not isinstance(fields, dict):
        raise InputError(f"{origin}: not a JSON object of plan_cost.Hardware's fields")
    known = p.Hardware.__dataclass_fields__
    if known_only:
        fields = {k: v for k, v in fields.items() if k in known}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise InputError(f"{origin}: no such field of plan_cost.Hardware: {', '.join(unknown)}")
    for key, value in fields.items():
        kind = _kind(known[key])
        number = kind in (int, float)
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, (int, float) if number else kind):
            raise InputError(f"{origin}: {key} is {json.dumps(value)[:40]}, not {_WORDS.get(kind, kind.__name__)}")
    return p.Hardware(**fields)


def from_file(p: ModuleType, path: str | Path) -> Any:
    """The hardware in a JSON file, or an :class:`InputError` of one line saying what is wrong."""
    origin = f"--hardware {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise InputError(f"{origin}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{origin}: cannot be read ({type(error).__name__})") from None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{origin}: not JSON ({error.msg}, line {error.lineno} column {error.colno})") from None
    return from_fields(p, fields, origin)


def measured(p: ModuleType, ranks: int = 4, folder: Path | None = None) -> Any:
    """This machine measured now: ``plan_measure.py --measure`` (matmul rate per shape, memory
    bandwidth, one small operation, the cores ``ranks`` busy ranks get) and ``plan_measure.py
    --sweep`` under ``torchrun`` (alpha, beta and burst of gloo's all-reduce on loopback), each
    run's report checked (:func:`checked`)."""
    folder = Path(folder or scratch.folder("ddpguide-plan-"))
    path = folder / "hw.json"
    checked(search.run_step("--measure", str(path), "--ranks", str(ranks), echo=False, timeout=300,
                            workdir=folder / "measure", program=search.MEASURE, report=True))
    checked(search.run_step("--sweep", str(path), launcher=torchrun(ranks), echo=False, timeout=300,
                            workdir=folder / "sweep", env={"OMP_NUM_THREADS": "1"}, program=search.MEASURE,
                            report=True))
    hw = from_file(p, path)
    hw.gpus_per_node = max(hw.gpus_per_node, ranks)
    return hw


def checked(done: Any) -> dict[str, Any]:
    """The report of a ``plan_measure.py`` run (read through :mod:`ddpguide.launch.report`);
    :class:`ReportError` (one line) naming the checks that failed."""
    found = done.report
    if found is None:
        raise ReportError(f"{done.command}: no report")
    if reports.failed(found):
        raise ReportError(f"{done.command}: failed checks: {', '.join(reports.failed(found))}")
    return found


def load(p: ModuleType, which: str, ranks: int = 4) -> Any:
    """What ``--hardware`` names: a data sheet, a ``.json`` file, or ``this-machine`` (measured
    now with ``ranks`` ranks); ``cluster`` is :func:`ddpguide.plan.measure.cluster_hardware`'s."""
    if which == "this-machine":
        return measured(p, ranks)
    if which.endswith(".json"):
        return from_file(p, which)
    return named(p, which)
