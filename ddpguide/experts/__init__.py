"""Mixture of experts and expert parallelism (chapter 12): the machinery around
``book/programs/moe_expert_parallel.py``.

The layer itself lives only in the program; each check imports it by path
(:func:`ddpguide.launch.programs.load`, afresh on each call).

* :mod:`ddpguide.experts.traffic`: the bytes the all-to-alls move, counted on real
  ranks, against the formula for a balanced router;
* :mod:`ddpguide.experts.viz`: tokens per expert, balanced and with a hot expert, and the
  program's balance run (the busiest expert's load and the z-loss, per step).
"""
