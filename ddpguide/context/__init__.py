"""Context parallelism (chapter 11): the machinery around ``book/programs/ring_attention.py``.

The attention itself lives only in the program; this package imports it by path
(:func:`ddpguide.launch.programs.load`) to count its block products and bytes against the
formulas (:mod:`ddpguide.context.program`), and measures its memory per rank against the sequence length
(:mod:`ddpguide.context.memory`, figures in :mod:`ddpguide.context.viz`).
"""
