"""The GitHub Actions workflows are valid, and say what the README says they do.

Each file in ``.github/workflows`` is validated against SchemaStore's GitHub
workflow schema, as vendored (pinned, offline) by the ``check-jsonschema``
package, and against its companion schema that requires ``timeout-minutes``
on every job. The schema cannot see the rest, so these tests also check the
structure: every job has ``runs-on`` and steps, every step either runs a
command or uses an action, ``needs`` names existing jobs without a cycle, the
CPU job runs ``.ci/run``, and the self-hosted GPU labels are documented.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def load_workflow(path: Path) -> dict:
    """YAML 1.1 reads the key ``on`` as True: give it its name back."""
    document = yaml.safe_load(path.read_text())
    if True in document:
        document["on"] = document.pop(True)
    return document


def vendored_schema(*parts: str) -> dict:
    try:
        files = resources.files("check_jsonschema")
    except ModuleNotFoundError:
        reason = "check-jsonschema (which ships the GitHub workflow schema) is not installed"
        if IN_CI:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason + ": pip install -r requirements.txt")
    return json.loads(files.joinpath("builtin_schemas", *parts).read_text())


@pytest.fixture(scope="module")
def schemas() -> list[dict]:
    return [vendored_schema("vendor", "github-workflows.json"),
            vendored_schema("custom", "github-workflows-require-timeout.json")]


def test_there_are_workflows():
    assert [p.name for p in WORKFLOWS] == ["ci.yml"]


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_matches_github_schema(path: Path, schemas: list[dict]):
    workflow = load_workflow(path)
    for schema in schemas:
        validator = jsonschema.validators.validator_for(schema)(schema)
        errors = sorted(validator.iter_errors(workflow), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(
            f"{path.name}: {'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors)


def test_schema_rejects_a_broken_workflow(schemas: list[dict]):
    broken = {"on": "push", "jobs": {"build": {"steps": [{"run": "true"}], "runs-on": "x",
                                               "timeout-minutes": 5, "unknown-key": 1}}}
    validator = jsonschema.validators.validator_for(schemas[0])(schemas[0])
    assert not validator.is_valid(broken)
    no_timeout = {"on": "push", "jobs": {"build": {"runs-on": "x", "steps": [{"run": "true"}]}}}
    assert not jsonschema.validators.validator_for(schemas[1])(schemas[1]).is_valid(no_timeout)


def structure_problems(workflow: dict) -> list[str]:
    """What the schema cannot check: steps, ``needs`` and their order."""
    jobs = workflow.get("jobs") or {}
    problems = []
    for name, job in jobs.items():
        if "uses" in job:  # a reusable workflow call has no runs-on or steps
            continue
        if "runs-on" not in job:
            problems.append(f"job {name}: no runs-on")
        steps = job.get("steps") or []
        if not steps:
            problems.append(f"job {name}: no steps")
        for index, step in enumerate(steps):
            if ("run" in step) == ("uses" in step):
                problems.append(f"job {name}, step {index}: needs exactly one of run / uses")
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            if need not in jobs:
                problems.append(f"job {name}: needs unknown job {need!r}")
    visiting, done = set(), set()

    def visit(name: str) -> None:
        if name in done or name not in jobs:
            return
        if name in visiting:
            problems.append(f"job {name}: its needs form a cycle")
            return
        visiting.add(name)
        needs = jobs[name].get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            visit(need)
        visiting.discard(name)
        done.add(name)

    for name in jobs:
        visit(name)
    return problems


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_structure(path: Path):
    problems = structure_problems(load_workflow(path))
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_structure_check_finds_mistakes():
    workflow = {"jobs": {
        "a": {"runs-on": "x", "steps": [{"run": "true", "uses": "actions/checkout@v4"}], "needs": "b"},
        "b": {"runs-on": "x", "steps": [{"name": "nothing"}], "needs": ["a", "c"]},
        "d": {"steps": []},
    }}
    problems = structure_problems(workflow)
    assert "job a, step 0: needs exactly one of run / uses" in problems
    assert "job b, step 0: needs exactly one of run / uses" in problems
    assert "job b: needs unknown job 'c'" in problems
    assert any("cycle" in p for p in problems)
    assert {"job d: no runs-on", "job d: no steps"} <= set(problems)


def test_cpu_job_runs_ci_script():
    workflow = load_workflow(ROOT / ".github" / "workflows" / "ci.yml")
    commands = [step.get("run", "") for step in workflow["jobs"]["cpu"]["steps"]]
    assert "bash .ci/run" in commands
    assert (ROOT / ".ci" / "run").is_file()


def test_gpu_job_uses_documented_self_hosted_labels_and_nccl():
    job = load_workflow(ROOT / ".github" / "workflows" / "ci.yml")["jobs"]["multi-gpu"]
    labels = job["runs-on"]
    assert labels[0] == "self-hosted" and "gpu" in labels
    readme = (ROOT / "README.md").read_text()
    assert f"[{', '.join(labels)}]" in readme, f"README.md does not list the runner labels {labels}"
    assert job["env"]["DDPGUIDE_BACKEND"] == "nccl"
    commands = "\n".join(step.get("run", "") for step in job["steps"])
    assert "--nbmake" in commands and "ddpguide.bench" in commands


def test_every_chapter_states_its_ranks_and_the_gpu_job_runs_it_where_it_fits():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_chapters", ROOT / "tools" / "gpu_chapters.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    notebooks = sorted(path.stem for path in (ROOT / "book").glob("*.ipynb"))
    assert set(tool.RANKS) == set(notebooks)
    fit, rest = tool.select(2, fit=True), tool.select(2, fit=False)
    assert sorted(fit + rest) == [f"book/{name}.ipynb" for name in notebooks]
    assert "book/10_debugging.ipynb" in fit and "book/06_sbp.ipynb" in rest  # 2 x 2 meshes
    assert tool.select(8, fit=False) == []
    commands = "\n".join(step.get("run", "") for step in
                         load_workflow(ROOT / ".github" / "workflows" / "ci.yml")["jobs"]["multi-gpu"]["steps"])
    assert "tools/gpu_chapters.py --fit" in commands and "tools/gpu_chapters.py --no-fit" in commands
