"""ddpguide: the companion package of the book.

The package is laid out as the book's map: one subpackage per idea, each
standing on ``core``. The chapters' own code is in ``book/programs/`` and in
their code cells; the package is the machinery around the lesson (launching
from a notebook, the checks that prove a claim, figures, benchmarks and the
command lines).

==============================  ======================================
chapter                         where its machinery lives
==============================  ======================================
1  DDP launched with mp.spawn   ``launch.spawn``, ``ddp.equivalence``, ``train``
2  collectives from scratch     ``collectives``, ``ddp.by_hand``
3  torchrun                     ``launch.torchrun``, ``launch.whoami``, ``train.cli``
4  elastic training             ``elastic`` (``python -m ddpguide.elastic``)
5  model and pipeline parallel  ``pipeline``
6  SBP on DTensor               ``sbp``
7  mixed precision              ``train.amp``, ``train.syncbn``, ``ddp.pitfalls``
8  sharded data parallelism     ``sharding``
9  tensor parallelism, 2-D      ``sharding``
10 when a job hangs             ``doctor`` (``python -m ddpguide.doctor``)
11 context parallelism          ``context``
12 mixture of experts           ``experts``
13 pipeline schedules           ``pipeline.zoo``, ``pipeline.viz``
appendix                        ``bench`` (``python -m ddpguide.bench SUITE``)
==============================  ======================================

Import rules, held by ``tests/test_layout.py``:

* ``core`` (runtime, process_group, checkpoint, data, models, ranklog,
  processes) imports nothing else from ddpguide;
* ``launch`` imports only ``core``;
* an idea package imports ``core`` and ``launch``, and ``collectives``,
  ``train`` or ``sbp`` where it builds on them, never ``bench``;
* ``bench`` is on top and imported by no module of the package;
* no import circle, and no module over 300 lines;
* figures (``viz``) sit on top of the code they draw: no other module of
  their subpackage imports them.
"""
