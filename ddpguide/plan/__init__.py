"""Choosing a layout (chapter 16): memory and step time predicted by ``book/programs/plan_cost.py``
(the formulas) and ``plan_step.py`` (the step) from the model's shapes, the layout and the
hardware's data sheet or microbenchmarks; every
layout searched and ranked (``python -m ddpguide.plan``); the predictions checked against
runs of the capstone's ``train.py`` on chapter 15's emulated cluster (``measure``, ``saved``),
against torch's own memory tracker (``tracker``) and against published GPU runs
(``published``)."""
