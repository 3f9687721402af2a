"""Starting and watching processes, the one place the package does so.

* ``ranks``: the one runner (start, one deadline loop, one stop, one result: ``Ended``, with
  ``ended`` and ``rank_files`` beside it); ``warm`` and ``forked``: ranks forked from a warm
  server, the tests' fast path;
* the faces on it: ``spawn`` (a function on N ranks, from a notebook, with ``child``),
  ``torchrun`` (torchrun agents on one machine) and ``programs`` (the book's programs, run as a
  reader types them; the only way into ``book/programs/``);
* ``report``: what a program writes with ``--report FILE``, and its one reader;
* ``whoami``: what each worker is told;
* ``starts`` and ``ran``: every command the runner execs recorded (``DDPGUIDE_RAN``), and the
  check that each program ran once as its ``Run:`` line types it.
"""
