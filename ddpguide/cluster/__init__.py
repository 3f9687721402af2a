"""A cluster on one machine: nodes are network namespaces joined by rate-limited links.

``with up(Spec(nodes=2, ranks_per_node=2, link="1gbit")) as cluster:`` makes
the nodes for the block; ``python -m ddpguide.cluster up|run|down|list`` does
the same from a shell (see :mod:`ddpguide.cluster.__main__`). Modules:

* :mod:`~ddpguide.cluster.spec`: the shape, names and addresses, checked first;
* :mod:`~ddpguide.cluster.netns`: ``ip``/``tc`` calls, each node's hosts file, the
  ownership records;
* :mod:`~ddpguide.cluster.cluster`: the context manager and a running cluster (a command
  on node k runs with host name ``nodek``);
* :mod:`~ddpguide.cluster.processes`: the one place processes are started;
* :mod:`~ddpguide.cluster.experiments` and :mod:`~ddpguide.cluster.faults`: the chapter's
  programs (read back through their ``--report``), the doctor, and a dead link.

Chapter 4's elastic run that loses a node by its link stands on ``elastic`` too, so it
is :mod:`ddpguide.bench.cluster_elastic`, above both.
"""

from ddpguide.cluster.cluster import Cluster, up
from ddpguide.cluster.netns import MissingPrerequisite
from ddpguide.cluster.spec import Node, Spec

__all__ = ["Cluster", "MissingPrerequisite", "Node", "Spec", "up"]
