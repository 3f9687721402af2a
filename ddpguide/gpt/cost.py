"""The cost of a layout of ``book/programs/gpt/train.py``: predicted, counted, timed.

:func:`measure` runs the program with ``--cost`` and reads the ``cost`` of its
``--report`` file (the prediction of ``cost_model.py`` for every rank, and what every rank
counted and measured in one step with ``cost_meter.py``); :func:`compare` puts them side
by side. The step time is predicted from a latency-bandwidth (alpha-beta) model of gloo,
fitted to timed all-reduces (:func:`fit_alpha_beta`), and the compute time from the step's model FLOPs at the
FLOP/s one process reaches on the same model (:func:`predict_step_seconds`).
"""

from __future__ import annotations

from pathlib import Path

from ddpguide.core import scratch
from ddpguide.gpt.layouts import CHECK, PROGRAM
from ddpguide.launch.programs import ProgramRun, run, torchrun
from ddpguide.launch.report import ReportError

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
MEMORY = ("parameters", "gradients", "optimizer", "activations", "unsharded")


def measure(options: tuple[str, ...], ranks: int, extra: tuple[str, ...] = CHECK,
            timeout: float = 300.0, workdir: Path | None = None,
            env: dict[str, str] | None = None) -> tuple[dict, ProgramRun]:
    """Run one layout with ``--cost``: the cost it reported, and the run itself."""
    launcher = ("python",) if ranks == 1 else torchrun(ranks)
    folder = Path(workdir or scratch.folder("ddpguide-cost-"))
    done = run(PROGRAM, *options, *extra, "--cost", launcher=launcher, timeout=timeout,
               echo=False, workdir=folder, env=env, report=True)
    return parse(done), done


def parse(done: ProgramRun) -> dict:
    """The ``cost`` of the report of a run with ``--cost`` and ``--report``."""
    if done.report is None or not isinstance(done.report.get("cost"), dict):
        raise ReportError(f"{done.command}: its report holds no cost (run it with --cost and "
                          "report=True; the second step is the one counted)")
    return done.report["cost"]


def compare(result: dict) -> dict:
    """Counted over predicted bytes by kind (all ranks together; 1.0 where both are 0),
    whether every rank's count equals its own prediction (all-to-all: routing decides
    each rank's share, only the total is predicted), and measured over predicted memory
    by part: the largest ratio over the ranks, and all ranks together (``memory_mean``:
    under EP a rank's activations, like its all-to-all, depend on the routing). The parts
    are :data:`MEMORY`, FSDP2's ``unsharded`` copies among them."""
    predicted, counted = result["predicted"]["bytes"], result["counted"]
    out: dict = {"bytes": {}, "per_rank": {}, "memory": {}, "memory_mean": {}}
    for kind in KINDS:
        p, c = sum(r[kind] for r in predicted), sum(r[kind] for r in counted)
        out["bytes"][kind] = {"predicted": p, "counted": c, "ratio": c / p if p else float(c == 0)}
        out["per_rank"][kind] = all(a[kind] == b[kind] for a, b in zip(predicted, counted))
    for part in MEMORY:
        pairs = list(zip(result["memory"], result["predicted"]["memory"]))
        out["memory"][part] = max(_ratio(m[part], p[part]) for m, p in pairs)
        out["memory_mean"][part] = _ratio(sum(m[part] for m, _ in pairs), sum(p[part] for _, p in pairs))
    return out


def _ratio(measured: float, predicted: float) -> float:
    """Measured over predicted; 1.0 where both are 0 (no FSDP2: nothing unsharded)."""
    return measured / predicted if predicted else float(measured == 0)


def ring_steps(kind: str, ranks: int) -> int:
    """Messages in a row one call of this kind costs (gloo's ring algorithms)."""
    return {"all_reduce": 2 * (ranks - 1), "send_recv": 1}.get(kind, ranks - 1)


def wire_bytes(kind: str, ranks: int, put_in: float) -> float:
    """Bytes one rank sends for ``put_in`` bytes put into a collective (the count's unit)."""
    if kind == "all_gather":
        return (ranks - 1) * put_in  # every other rank's shard passes through
    if kind == "all_reduce":
        return 2 * (ranks - 1) / ranks * put_in
    if kind == "send_recv":
        return put_in
    return (ranks - 1) / ranks * put_in  # reduce-scatter, all-to-all


def fit_alpha_beta(samples: list[tuple[str, int, float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = alpha x steps + beta x wire bytes`` over samples
    ``(kind, ranks, bytes put in, seconds)``: alpha in seconds a message, beta a byte."""
    rows = [(ring_steps(k, n), wire_bytes(k, n, b), t) for k, n, b, t in samples]
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    if det == 0:
        raise ValueError("fit_alpha_beta: the samples do not separate latency from bandwidth")
    return (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det


def communication_seconds(result: dict, fit: tuple[float, float]) -> float:
    """The busiest rank's predicted time in collectives, from what it counted by call."""
    alpha, beta = fit
    per_rank = []
    for calls in result["calls"]:
        seconds = 0.0
        for key, (count, put_in) in calls.items():
            kind, ranks = key.split("/")
            seconds += (alpha * count * ring_steps(kind, int(ranks))
                        + beta * wire_bytes(kind, int(ranks), put_in))
        per_rank.append(seconds)
    return max(per_rank)


def growing_seconds(result: dict, beta: float, efficiency: float, pipeline_stages: int = 1,
                    cores: int | None = None) -> float:
    """What of a step grows with the model: the busiest rank's compute (as in
    :func:`predict_step_seconds`, times ranks / cores when the ranks share fewer cores)
    and its bytes on the wire (beta x ring bytes), with no latency term."""
    ranks = len(result["memory"])
    compute = result["predicted"]["flops"] / ranks / (efficiency * result["peak_flops"])
    if pipeline_stages > 1:
        m = result.get("microbatches", 2 * pipeline_stages)
        compute *= (m + pipeline_stages - 1) / m
    compute *= max(1.0, ranks / (cores or ranks))
    return compute + communication_seconds(result, (0.0, beta))


def predict_from_narrow(result: dict, narrow: dict, beta: float, efficiency: float,
                        pipeline_stages: int = 1, cores: int | None = None) -> float:
    """The step of ``result``'s layout from the same layout's measured step on a narrow
    model (``narrow``): what does not grow with the width (Python, DTensor, FSDP2 and
    schedule work per operation, gloo's latency per message, which both runs send alike)
    is taken from the narrow step; what grows with it is predicted for both
    (:func:`growing_seconds`) and the difference added."""
    grow = (growing_seconds(result, beta, efficiency, pipeline_stages, cores)
            - growing_seconds(narrow, beta, efficiency, pipeline_stages, cores))
    return narrow["step_seconds"] + grow


def predict_step_seconds(result: dict, fit: tuple[float, float], efficiency: float,
                         pipeline_stages: int = 1) -> float:
    """Compute (the step's FLOPs shared by the ranks, at ``efficiency`` x the matmul peak
    each rank measured) plus communication. A pipeline's ranks work one after another
    for part of the step: its compute is the stage's share of the FLOPs times the
    1F1B/GPipe length (micro-batches + stages - 1) over the micro-batches, which
    ``pipeline_stages`` and the ``microbatches`` of the run give."""
    ranks = len(result["memory"])
    compute = result["predicted"]["flops"] / ranks / (efficiency * result["peak_flops"])
    if pipeline_stages > 1:
        m = result.get("microbatches", 2 * pipeline_stages)
        compute *= (m + pipeline_stages - 1) / m
    return compute + communication_seconds(result, fit)
