"""Mixture of experts and expert parallelism (chapter 12): the machinery around
``book/programs/moe_expert_parallel.py``.

* :mod:`ddpguide.experts.program`: the chapter's program, loaded by path (the layer
  itself lives only there);
* :mod:`ddpguide.experts.traffic`: the bytes the all-to-alls move, counted on real
  ranks, against the formula for a balanced router;
* :mod:`ddpguide.experts.viz`: tokens per expert, balanced and with a hot expert.
"""
