"""Programs across the nodes: one ``torchrun --nnodes N --node-rank K`` inside each node.

The static rendezvous (torchrun's default) is at node 0's address; each node's
torchrun is started inside that node's namespace with ``GLOO_SOCKET_IFNAME``
(and ``NCCL_SOCKET_IFNAME``) naming the node's interface, so the ranks talk over
the rate-limited link, and ranks of one node over that node's loopback.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddpguide.cluster.cluster import Cluster
from ddpguide.launch.ranks import RankEnd

RDZV_PORT = 29500  # the port is inside the cluster's own namespaces: no other program uses it


def torchrun_argv(cluster: Cluster, node_index: int, program: list[str],
                  torchrun_options: tuple[str, ...] = ()) -> list[str]:
    """The command a reader types on node ``node_index`` (after ``ip netns exec NODE``)."""
    node0 = cluster.nodes[0]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
            "--nproc-per-node", str(cluster.spec.ranks_per_node), "--node-rank", str(node_index),
            "--rdzv-endpoint", f"{node0.address}:{RDZV_PORT}", *torchrun_options, *program]


def torchrun_on(cluster: Cluster, program: list[str], timeout: float, *,
                cwd: str | Path | list[Path] | None = None, torchrun_options: tuple[str, ...] = (),
                capture: bool = True, **kwargs: object) -> list[RankEnd]:
    """Start ``program`` on every node at once; all end, or all are stopped, in ``timeout`` s
    (``kwargs`` go to :meth:`Cluster.run`)."""
    work = [(node, torchrun_argv(cluster, node.index, program, torchrun_options))
            for node in cluster.nodes]
    return cluster.run(work, timeout, cwd=cwd, capture=capture, **kwargs)  # type: ignore[arg-type]
