"""Every layout of ``book/programs/gpt/train.py``, run and compared with one process.

A layout is the program's own command line (``--pp 2 --dp-shard 2 --tp 2``); each run
writes its losses to its report (``--report``, read with :mod:`ddpguide.launch.report`)
and its stages' whole parameters to a folder (``--out``), and :func:`compare` reads both
against the one-process run of the same steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ddpguide.core import scratch
from ddpguide.launch.programs import ProgramRun, run, torchrun
from ddpguide.launch.report import ReportError

PROGRAM = "gpt/train.py"

#: the mixture of experts of the table: 4 experts, grouped-query attention (2 key/value heads);
#: top-1, or top-2 with the gates renormalised
MOE = ("--experts", "4", "--kv-heads", "2")
TOP2 = (*MOE, "--top-k", "2", "--renormalize")

#: (name, ranks, the layout's options): the chapter's table, in the order it is shown.
LAYOUTS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("1 process", 1, ()),
    ("DDP 2", 2, ("--dp-replicate", "2")),
    ("FSDP2 2", 2, ("--dp-shard", "2")),
    ("HSDP 2 x 2", 4, ("--dp-replicate", "2", "--dp-shard", "2")),
    ("TP 2", 2, ("--tp", "2")),
    ("PP 2", 2, ("--pp", "2")),
    ("CP 2", 2, ("--cp", "2")),
    ("FSDP x TP 2 x 2", 4, ("--dp-shard", "2", "--tp", "2")),
    ("PP x FSDP 2 x 2", 4, ("--pp", "2", "--dp-shard", "2")),
    ("PP x TP 2 x 2", 4, ("--pp", "2", "--tp", "2")),
    ("CP x FSDP 2 x 2", 4, ("--cp", "2", "--dp-shard", "2")),
    ("PP x FSDP x TP 2 x 2 x 2", 8, ("--pp", "2", "--dp-shard", "2", "--tp", "2")),
    ("FSDP x TP 2 x 2 (GQA)", 4, ("--dp-shard", "2", "--tp", "2", "--kv-heads", "2")),
    ("EP 2 (MoE)", 2, ("--ep", "2", *MOE)),
    ("EP 2 (MoE, top-2)", 2, ("--ep", "2", *TOP2)),
    ("DDP x EP 2 x 2 (MoE, top-2)", 4, ("--dp-replicate", "2", "--ep", "2", *TOP2)),
    ("EP x FSDP 2 x 2 (MoE)", 4, ("--dp-shard", "2", "--ep", "2", *MOE)),
    ("CP x EP 2 x 2 (MoE, top-2)", 4, ("--cp", "2", "--ep", "2", *TOP2)),
    ("PP x EP 2 x 2 (MoE)", 4, ("--pp", "2", "--ep", "2", *MOE)),
)
#: the 16-rank 4-D layout: a slow test of its own (``make test-slow``)
FOUR_D = ("PP x FSDP x TP x CP 2 x 2 x 2 x 2", 16,
          ("--pp", "2", "--dp-shard", "2", "--tp", "2", "--cp", "2"))

#: the model and steps of the checks: float64, small enough for 8 ranks on 2 cores
CHECK = ("--dtype", "float64", "--dim", "32", "--heads", "4", "--layers", "2", "--seq", "16",
         "--batch", "8", "--steps", "3")


def check_options(**changes) -> tuple[str, ...]:
    """CHECK with some options changed (``steps=5``); a value of None adds the bare flag."""
    options = list(CHECK)
    for name, value in changes.items():
        flag = "--" + name.replace("_", "-")
        if flag in options:
            options[options.index(flag) + 1] = str(value)
        else:
            options += [flag] if value is None else [flag, str(value)]
    return tuple(options)


@dataclass(frozen=True)
class LayoutRun:
    name: str
    ranks: int
    losses: list[float]
    first_step: int
    parameters: dict  # name -> whole tensor (expert shards joined)
    seconds: float
    run: ProgramRun


def launch(options: tuple[str, ...], ranks: int, out: Path, extra: tuple[str, ...] = CHECK,
           timeout: float = 300.0, echo: bool = False, name: str = "") -> LayoutRun:
    """Run the program on one layout; read its report (the losses, and the cost with
    ``--cost``: :func:`ddpguide.gpt.cost.parse`) and the parameters it wrote to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    launcher = ("python",) if ranks == 1 else torchrun(ranks)
    started = time.monotonic()
    done = run(PROGRAM, *options, *extra, "--out", str(out), launcher=launcher,
               timeout=timeout, echo=echo, workdir=out / "program", report=True)
    losses, first, _ = trained(done.report, done.command)
    return LayoutRun(name or " ".join(options) or "1 process", ranks, losses, first,
                     parameters_of(out), time.monotonic() - started, done)


def trained(report: dict | None, what: str) -> tuple[list[float], int, dict]:
    """The ``losses``, ``first_step`` and ``layout`` of a report of the program (read with
    :func:`ddpguide.launch.report.read`); :class:`ReportError` (one line) if one is missing."""
    found = report or {}
    losses, first, layout = found.get("losses"), found.get("first_step"), found.get("layout")
    if not (isinstance(losses, list) and all(isinstance(v, float) for v in losses)
            and type(first) is int and isinstance(layout, dict)):
        raise ReportError(f"{what}: its report holds no losses (numbers), first_step (a whole "
                          "number) and layout (an object)")
    return losses, first, layout


def parameters_of(out: Path) -> dict:
    """The whole model from the files of every stage; experts joined in ep order."""
    import torch

    files = sorted(out.glob("params-pp*-ep*.pt"),
                   key=lambda p: tuple(int(x) for x in p.stem[len("params-pp"):].split("-ep")))
    whole: dict = {}
    shards: dict = {}
    for path in files:
        for key, tensor in torch.load(path, weights_only=True).items():
            if ".experts." in key:
                shards.setdefault(key, []).append(tensor)
            else:
                whole.setdefault(key, tensor)
    for key, pieces in shards.items():
        # a stage file per (pp, ep): the same stage's pieces appear once per ep rank
        whole[key] = torch.cat(pieces)
    return whole


def compare(reference: LayoutRun, other: LayoutRun) -> tuple[float, float]:
    """Max |loss difference| over the steps, max |parameter difference| over every weight."""
    if len(reference.losses) != len(other.losses):
        raise AssertionError(f"{other.name}: {len(other.losses)} steps, not {len(reference.losses)}")
    if set(reference.parameters) != set(other.parameters):
        missing = sorted(set(reference.parameters) ^ set(other.parameters))
        raise AssertionError(f"{other.name}: parameters differ in name: {missing[:4]}")
    loss = max(abs(a - b) for a, b in zip(reference.losses, other.losses))
    params = max((reference.parameters[k] - other.parameters[k]).abs().max().item()
                 for k in reference.parameters)
    return loss, params


def model_options(options: tuple[str, ...]) -> tuple[str, ...]:
    """The options that change the model, not its layout (``--experts 4``, ``--renormalize``)."""
    axes = {"--pp", "--dp-replicate", "--dp-shard", "--cp", "--ep", "--tp"}
    kept, skip = [], False
    for option in options:
        if not skip and option not in axes:
            kept.append(option)
        skip = option in axes  # an axis and its degree
    return tuple(kept)


def equivalence_table(layouts=LAYOUTS, workdir: Path | None = None, progress=None,
                      extra: tuple[str, ...] = CHECK, runs: dict | None = None) -> list[dict]:
    """Each layout against the first (one process): the rows of the chapter's table.

    ``extra`` are the options of every run (``(*CHECK, "--cost")`` also counts each
    layout's cost, which the tests read); ``runs``, when given, receives each layout's
    :class:`LayoutRun` by name."""
    root = Path(workdir or scratch.folder("ddpguide-gpt-"))
    rows: list[dict] = []
    references: dict[tuple[str, ...], LayoutRun] = {}
    for i, (name, ranks, options) in enumerate(layouts):
        result = launch(options, ranks, root / f"layout{i}", extra=extra, name=name)
        if runs is not None:
            runs[name] = result
        model = model_options(options)
        if model not in references:  # the one process of the same model (the MoE has its own)
            references[model] = result if ranks == 1 else launch(
                model, 1, root / f"reference{len(references)}", extra=extra, name="1 process")
        loss, params = compare(references[model], result)
        rows.append({"layout": name, "ranks": ranks, "loss_difference": loss,
                     "parameter_difference": params, "seconds": round(result.seconds, 1)})
        if progress:
            progress(rows[-1])
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| layout | ranks | largest loss difference | largest parameter difference | seconds |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['loss_difference']:.1e} | "
                     f"{r['parameter_difference']:.1e} | {r['seconds']:.1f} |")
    return "\n".join(lines)
