"""Choosing a layout (chapter 16): memory and step time predicted by ``book/programs/plan_cost.py``
from the model's shapes, the layout and the hardware's data sheet or microbenchmarks; every
layout searched and ranked (``python -m ddpguide.plan``); the predictions checked against
measured runs of the capstone's ``train.py`` and against published GPU runs."""
