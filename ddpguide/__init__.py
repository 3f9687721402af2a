"""ddpguide: the companion package of the book.

The package is laid out as the book's map: one subpackage per idea, each
standing on ``core``. The chapters' own code is in ``book/programs/`` and in
their code cells; the package is the machinery around the lesson (launching
from a notebook, the checks that prove a claim, figures, benchmarks and the
command lines).

chapter                         where its machinery lives
==============================  ======================================
1  DDP launched with mp.spawn   ``launch.spawn``, ``train``
2  collectives from scratch     ``collectives``, ``ddp.by_hand``
3  torchrun                     ``launch.torchrun``, ``launch.whoami``, ``train.cli``, ``train.torchrun_demo``
4  elastic training             ``elastic`` (``python -m ddpguide.elastic``)
5  model and pipeline parallel  ``pipeline``
6  SBP on DTensor               ``sbp``
7  mixed precision              ``train.amp``, ``train.amp_program``, ``train.syncbn``, ``ddp.pitfalls``
8  sharded data parallelism     ``sharding``
9  tensor parallelism, 2-D      ``sharding``
10 when a job hangs             ``doctor`` (``python -m ddpguide.doctor``)
11 context parallelism          ``context``
12 mixture of experts           ``experts``
13 pipeline schedules           ``pipeline.zoo``, ``pipeline.timeline``, ``pipeline.viz``
14 a GPT on every layout        ``gpt`` (``python -m ddpguide.gpt``)
15 from a laptop to a cluster   ``cluster`` (``python -m ddpguide.cluster``)
16 choosing a layout            ``plan`` (``python -m ddpguide.plan``)
17 failures at scale            ``failures``
18 a scheduler: Slurm           ``slurm`` (``python -m ddpguide.slurm``)
appendix                        ``bench`` (``python -m ddpguide.bench SUITE``)
==============================  ======================================
=======
The chapter map is :data:`CHAPTERS`, written here only: for each notebook,
the package modules its code cells import, and the package commands it runs.
``tests/test_chapter_map.py`` reads every notebook and fails when the map
disagrees with it, and checks the tables of ``README.md`` and
``book/intro.md`` against it.

Import rules: the ``ALLOWED`` table of ``tests/test_layout.py`` says which
subpackage may import which, and that test holds it, with these:

* ``core`` (runtime, process groups, meshes, checkpoints, data, models,
  command lines, timeouts, rank-aware logging, processes) imports nothing
  else from ddpguide;
* ``launch`` imports only ``core``;
* an idea package imports ``core`` and ``launch``, and the idea packages it
  builds on, as ``ALLOWED`` lists them, never ``bench``;
* ``bench`` is on top and imported by no module of the package;
* no import circle, and no module over 300 lines;
* figures (``viz``) sit on top of the code they draw: no other module of
  their subpackage imports them.
"""

#: notebook (``book/<name>.ipynb``) -> (chapter, the ddpguide modules its code imports,
#: the ``python -m ddpguide.<command>`` commands it runs).
CHAPTERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "01_spawn_ddp": ("1", (
        "collectives.algorithms", "launch.programs", "launch.spawn",
    ), ("bench",)),
    "02_collectives": ("2", (
        "bench.allreduce", "bench.report", "collectives.algorithms", "collectives.demos",
        "collectives.viz", "core.models", "core.runtime", "ddp.by_hand", "launch.programs",
        "launch.spawn",
    ), ("bench",)),
    "03_torchrun": ("3", (
        "core.runtime", "launch.programs", "launch.torchrun", "train.torchrun_demo",
    ), ("train",)),
    "04_elastic": ("4", (
        "core.checkpoint", "elastic.demo", "elastic.failover", "elastic.plot",
        "elastic.program", "elastic.settings", "launch.programs",
    ), ("bench", "elastic")),
    "05_model_parallel": ("5", (
        "bench.appendix", "bench.pipeline_timing", "launch.programs", "launch.spawn",
        "pipeline.model_parallel", "pipeline.schedules", "pipeline.stages", "pipeline.timeline",
        "pipeline.viz", "pipeline.zoo",
    ), ("bench",)),
    "06_sbp": ("6", (
        "core.runtime", "launch.programs", "launch.spawn", "sbp.boxing_rules", "sbp.placements",
        "sbp.regions", "sbp.viz", "sbp.workers",
    ), ()),
    "07_amp": ("7", (
        "bench.amp", "core.runtime", "ddp.pitfalls", "ddp.pitfalls_data", "launch.programs",
        "launch.spawn", "train.amp", "train.amp_program", "train.loop", "train.syncbn",
    ), ("bench",)),
    "08_sharded_data_parallel": ("8", (
        "core.runtime", "launch.programs", "launch.spawn", "sbp.boxing_rules", "sharding.checks",
        "sharding.memory",
    ), ("bench", "doctor")),
    "09_tensor_parallel": ("9", (
        "core.runtime", "launch.programs", "launch.spawn", "sbp.boxing_rules",
        "sharding.dcp_kill", "sharding.dcp_workers", "sharding.mesh2d",
        "sharding.tensor_parallel",
    ), ()),
    "10_debugging": ("10", (
        "core.processes", "doctor.options", "doctor.stacks", "doctor.sweep", "launch.torchrun",
    ), ("doctor",)),
    "11_context_parallel": ("11", (
        "context.memory", "context.program", "context.viz", "launch.programs",
    ), ("bench",)),
    "12_mixture_of_experts": ("12", (
        "core.runtime", "experts.traffic", "experts.viz", "launch.programs",
    ), ("bench",)),
    "13_pipeline_schedules": ("13", (
        "launch.programs", "pipeline.timeline", "pipeline.viz", "pipeline.zoo", "sbp.boxing_rules",
    ), ("bench",)),
    "14_gpt_capstone": ("14", (
        "gpt.kernels", "gpt.layouts", "launch.programs",
    ), ("bench", "gpt")),
    "15_cluster": ("15", (
        "cluster.cluster", "cluster.experiments", "cluster.launch", "cluster.model", "cluster.netns",
        "cluster.spec",
    ), ("bench", "cluster", "doctor")),
    "16_plan": ("16", (
        "cluster.netns", "launch.programs", "plan.catalog", "plan.checks", "plan.command", "plan.measure",
        "plan.perturb", "plan.published", "plan.saved", "plan.search", "plan.tracker", "plan.viz",
    ), ("bench", "plan")),
    "17_failures": ("17", (
        "failures.__main__", "failures.cadence", "failures.checks", "failures.engine",
        "failures.runs", "launch.programs",
    ), ("bench", "failures")),
    "18_slurm": ("18", (
        "bench.slurm", "cluster.spec", "launch.programs", "launch.report", "slurm.ft", "slurm.jobs",
        "slurm.runs", "slurm.scheduler",
    ), ("bench", "slurm")),
    "appendix_measurements": ("appendix", (
        "bench.appendix", "bench.summary",
    ), ("bench",)),
}
