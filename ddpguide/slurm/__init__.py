"""Slurm on the cluster of chapter 15: a controller on node 0 and a ``slurmd`` on every node.

``with up(Spec(nodes=2)) as slurm:`` gives a working Slurm for the block;
``python -m ddpguide.slurm up|run|down|list`` does the same from a shell (see
:mod:`ddpguide.slurm.__main__`). Modules:

* :mod:`~ddpguide.slurm.config`: ``slurm.conf`` and the cluster's folder;
* :mod:`~ddpguide.slurm.daemons`: munge, the daemons inside the nodes, ``sinfo``'s states;
* :mod:`~ddpguide.slurm.scheduler`: the context manager, and the cleaning of what a
  killed driver left.
"""

from ddpguide.slurm.scheduler import MissingPrerequisite, Slurm, remove_dead, up

__all__ = ["MissingPrerequisite", "Slurm", "remove_dead", "up"]
