"""A running cluster, as a context manager: ``with up(Spec(...)) as cluster: ...``.

Leaving the block (normally, by an exception or by Ctrl-C) removes every
namespace and link it made; a driver killed outright leaves a record whose pid
is dead, and the next :func:`up` removes what it left first.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from ddpguide.cluster import netns
from ddpguide.cluster.processes import run_all
from ddpguide.cluster.spec import Node, Spec, names, rate_text
from ddpguide.launch.ranks import RankEnd


@dataclass
class Cluster:
    """The nodes of a cluster that exists now, and how to run commands on them."""

    run_id: str
    spec: Spec
    switch: str
    nodes: list[Node]

    def node(self, name: str | int) -> Node:
        """Node ``name`` (``node1``, ``1`` or 1)."""
        key = str(name).removeprefix("node")
        for node in self.nodes:
            if str(node.index) == key:
                return node
        raise KeyError(f"no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def env(self, node: Node, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a command on ``node``: the socket interface for gloo and nccl."""
        env = dict(os.environ if base is None else base)
        # One thread per process, as torchrun sets it for two or more local ranks: spinning
        # OpenMP threads of ranks sharing a few cores slow each other down many times over.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update({"GLOO_SOCKET_IFNAME": node.ifname, "NCCL_SOCKET_IFNAME": node.ifname})
        return env

    def prefix(self, node: Node) -> list[str]:
        """The command prefix that runs a program on ``node``: inside its network namespace
        (its interface, addresses and hosts file), and in a UTS namespace of its own whose
        host name is the node's name, as each machine of a cluster has its own."""
        return [*netns_prefix(node), "unshare", "--uts", sys.executable, "-c", SET_HOSTNAME,
                node.name]

    def run(self, work: dict[Node, list[str]] | list[tuple[Node, list[str]]], timeout: float,
            extra_env: dict[str, str] | None = None, **kwargs: object) -> list[RankEnd]:
        """Run one command per (node, argv) side by side, each on its node, with ``extra_env``
        over the node's environment (see ``run_all`` for the rest)."""
        pairs = list(work.items()) if isinstance(work, dict) else list(work)
        return run_all([self.prefix(n) + argv for n, argv in pairs], timeout,
                       env=[{**self.env(n), **(extra_env or {})} for n, _ in pairs],
                       **kwargs)  # type: ignore[arg-type]

    def counters(self, node: Node) -> dict[str, int]:
        """``node``'s interface counters (tx/rx bytes and packets), read inside its namespace."""
        stats = f"/sys/class/net/{node.ifname}/statistics"
        keys = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
        done = netns.sh(*netns_prefix(node), "cat", *(f"{stats}/{k}" for k in keys))
        return dict(zip(keys, (int(v) for v in done.stdout.split()), strict=True))

    def set_link(self, node: Node, up: bool) -> None:
        """Take ``node``'s link down (a cable pulled) or bring it back up."""
        netns.sh("ip", "-n", node.netns, "link", "set", node.ifname, "up" if up else "down")

    def table(self) -> str:
        """The nodes, their namespaces, interfaces, addresses and link rates."""
        rows = [("node", "namespace", "interface", "address", "link", "ranks")]
        rows += [(n.name, n.netns, n.ifname, n.address, rate_text(n.rate_bits),
                  str(self.spec.ranks_per_node)) for n in self.nodes]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        return "\n".join([f"cluster {self.run_id}: a star through switch namespace {self.switch} "
                          "(rates limited by tc tbf, both directions)", *lines])


#: sets the host name (in the new UTS namespace only) and becomes the command
SET_HOSTNAME = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
                "os.execvp(sys.argv[2], sys.argv[2:])")


def netns_prefix(node: Node) -> list[str]:
    """``ip netns exec NODE``: the node's network namespace only."""
    return ["ip", "netns", "exec", node.netns]


def from_record(record: dict[str, object]) -> Cluster:
    """The :class:`Cluster` a record describes (a cluster another process made)."""
    run_id = str(record["run_id"])
    spec = Spec(**record["spec"])  # type: ignore[arg-type]
    switch, nodes = names(run_id, spec)
    return Cluster(run_id, spec, switch, nodes)


@contextlib.contextmanager
def up(spec: Spec, *, holder: str = "program") -> Iterator[Cluster]:
    """Make a cluster of ``spec``'s shape for the ``with`` block, and remove it after.

    Raises :class:`netns.MissingPrerequisite` (nothing made) without root,
    ``ip`` or ``tc``. What dead drivers left is removed first.
    """
    missing = netns.missing_prerequisite()
    if missing:
        raise netns.MissingPrerequisite(missing)
    netns.remove_dead()
    run_id = secrets.token_hex(3)[:5]
    while netns.record_path(run_id).exists():
        run_id = secrets.token_hex(3)[:5]
    netns.write_record(run_id, spec, os.getpid(), holder)
    try:
        switch, nodes = netns.create(run_id, spec)
        yield Cluster(run_id, spec, switch, nodes)
    finally:
        netns.destroy(run_id)


def live_clusters() -> list[Cluster]:
    """The clusters on this machine whose driver is alive, with their records."""
    return [from_record(r) for r in netns.read_records().values() if netns.driver_alive(r)]


def chosen(run_id: str | None) -> Cluster:
    """Cluster ``run_id``, else the one live cluster started from this directory.

    Raises :class:`LookupError` with a one-line reason when there is none or
    more than one to choose from.
    """
    records = {k: r for k, r in netns.read_records().items() if netns.driver_alive(r)}
    if run_id is not None:
        if run_id not in records:
            raise LookupError(f"argument --cluster: no live cluster {run_id!r} "
                              f"(live: {', '.join(sorted(records)) or 'none'})")
        return from_record(records[run_id])
    here = [r for r in records.values() if r.get("cwd") == os.getcwd()]
    if len(here) != 1:
        what = "no live cluster was" if not here else f"{len(here)} live clusters were"
        raise LookupError(f"{what} started from this directory: name one with --cluster ID "
                          f"(live: {', '.join(sorted(records)) or 'none'})")
    return from_record(here[0])
