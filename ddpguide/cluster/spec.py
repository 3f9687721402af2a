"""What a cluster is made of, checked before anything is created: nodes, link rates, names.

A cluster of ``nodes`` nodes is a star: each node is a network namespace with
one interface, whose other end is a port of a bridge in a switch namespace of
its own. Each node's link is rate-limited in both directions by ``tc tbf``;
the slow node's link has its own rate.

Names carry the package's prefix and the run id, so that a cluster is found
(and a dead driver's leftovers removed) by name alone, and two clusters on one
machine never share a name. Interface names stay within Linux's 15 characters.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544): it is
reserved for test networks, so it is not a range a host's own network uses,
and it lives only inside the cluster's namespaces (every cluster has its own
namespaces, so two clusters may use the same addresses without meeting).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpguide.core.commands import InputError

PREFIX = "ddpg"
SUBNET = "198.18.0"  # node k is SUBNET.(k+1)/24
MAX_NODES = 8
MAX_RANKS_PER_NODE = 8
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MIN_RATE, MAX_RATE = 10**6, 10 * 10**9
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")


def parse_rate(text: str, option: str = "--link") -> int:
    """A tc rate such as ``1gbit`` or ``100mbit`` in bits per second (1mbit .. 10gbit)."""
    match = _RATE.match(text.strip().lower()) if isinstance(text, str) else None
    if not match:
        raise InputError(option, f"{text!r} is not a rate such as 1gbit, 400mbit or 100mbit")
    bits = int(float(match.group(1)) * RATE_UNITS[match.group(2)])
    if not MIN_RATE <= bits <= MAX_RATE:
        raise InputError(option, f"{text!r} is outside 1mbit .. 10gbit")
    return bits


def rate_text(bits: int) -> str:
    """``bits`` per second written as tc reads it (``1gbit``, ``250mbit``)."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits % RATE_UNITS[unit] == 0:
            return f"{bits // RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


@dataclass(frozen=True)
class Node:
    """One node of a running cluster: its namespace, interface, address and link rate."""

    index: int
    netns: str
    ifname: str
    address: str
    rate_bits: int

    @property
    def name(self) -> str:
        """The name commands use (``node0``, ``node1``, ...)."""
        return f"node{self.index}"


@dataclass(frozen=True)
class Spec:
    """A cluster's shape: checked at construction (:class:`InputError` on a bad value)."""

    nodes: int = 2
    ranks_per_node: int = 2
    link: str = "1gbit"
    slow_node: int | None = None
    slow_link: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 2 <= self.nodes <= MAX_NODES:
            raise InputError("--nodes", f"{self.nodes!r} is not a whole number in 2..{MAX_NODES}")
        if not isinstance(self.ranks_per_node, int) or not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise InputError("--ranks-per-node",
                             f"{self.ranks_per_node!r} is not a whole number in 1..{MAX_RANKS_PER_NODE}")
        parse_rate(self.link, "--link")
        if (self.slow_node is None) != (self.slow_link is None):
            raise InputError("--slow-node", "--slow-node and --slow-link go together")
        if self.slow_node is not None:
            if not isinstance(self.slow_node, int) or not 0 <= self.slow_node < self.nodes:
                raise InputError("--slow-node",
                                 f"{self.slow_node!r} is not a node index in 0..{self.nodes - 1}")
            parse_rate(self.slow_link or "", "--slow-link")

    def rate_of(self, index: int) -> int:
        """Node ``index``'s link rate in bits per second."""
        if index == self.slow_node and self.slow_link is not None:
            return parse_rate(self.slow_link, "--slow-link")
        return parse_rate(self.link, "--link")


def names(run_id: str, spec: Spec) -> tuple[str, list[Node]]:
    """The switch namespace and the nodes of cluster ``run_id`` (5 hex digits)."""
    if not re.fullmatch(r"[0-9a-f]{5}", run_id):
        raise ValueError(f"run id {run_id!r} is not 5 hex digits")
    switch = f"{PREFIX}-{run_id}-sw"
    nodes = [Node(k, f"{PREFIX}-{run_id}-node{k}", f"{PREFIX}{run_id}-n{k}",
                  f"{SUBNET}.{k + 1}", spec.rate_of(k)) for k in range(spec.nodes)]
    return switch, nodes


def port_name(run_id: str, index: int) -> str:
    """The switch-side end of node ``index``'s link."""
    return f"{PREFIX}{run_id}-s{index}"


def bridge_name(run_id: str) -> str:
    return f"{PREFIX}{run_id}-br"


def run_id_of(netns: str) -> str | None:
    """The run id in a namespace name of the package, or None for any other name."""
    match = re.fullmatch(rf"{PREFIX}-([0-9a-f]{{5}})-(?:sw|node\d+)", netns)
    return match.group(1) if match else None
