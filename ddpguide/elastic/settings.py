"""The knobs of an elastic run and their checks: what ``node`` mode passes to torchrun.

Nothing here imports torch, so ``--help`` and bad-input errors are instant.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import socket
from dataclasses import dataclass, field

from ddpguide.core.commands import InputError

# torchrun's own defaults, for comparison (torch/distributed/elastic/rendezvous).
TORCHRUN_RDZV_CONF = {
    "join_timeout": 600,          # a round must complete within this
    "last_call_timeout": 30,      # wait for late nodes once the minimum is there
    "keep_alive_interval": 5,     # heartbeat period of every agent
    "keep_alive_max_attempt": 3,  # missed heartbeats before a node is declared dead
}
TORCHRUN_MONITOR_INTERVAL = 0.1

# The package's defaults: recovery in seconds instead of tens of seconds.
TUNED_RDZV_CONF = {
    "join_timeout": 60,
    "last_call_timeout": 2,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
TUNED_MONITOR_INTERVAL = 0.25

# Since torch 2.5 (pytorch#128096) the rank-0 agent shares a TCPStore it hosts
# with the workers. It publishes that store's address (MASTER_ADDR) under the
# first round's keys only; an agent that joins a later round waits for the key
# of its round, which nobody writes, and dies after 60 s (pytorch#147064,
# #135712). Opting out restores the classic behaviour: the rank-0 worker hosts
# the workers' store on a fresh port every round.
STORE_SHARING_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


#: An invalid option (the message names it and its value): the package's one bad-input error.
UsageError = InputError


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:3"`` -> (1, 3); anything else raises :class:`UsageError`."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX with positive integers")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise UsageError(f"--nnodes {text!r}: the minimum must be at least 1")
    if low > high:
        raise UsageError(f"--nnodes {text!r}: the minimum ({low}) is larger than the maximum ({high})")
    return low, high


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port), or :class:`UsageError`."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or any(c.isspace() for c in host):
        raise UsageError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r}: port {port} is outside 1-65535")
    return host, int(port)


# What torch's c10d rendezvous reads from --rdzv-conf (dynamic_rendezvous.py,
# c10d_rendezvous_backend.py; "timeout" comes from the launcher). Any other
# key is ignored by torch without a word, so a misspelt one is refused here.
RDZV_INT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                 "keep_alive_interval", "keep_alive_max_attempt", "read_timeout", "timeout")
RDZV_FALSE_WORDS = ("0", "false", "f", "no", "n")  # RendezvousParameters.get_as_bool's
RDZV_BOOL_WORDS = ("1", "true", "t", "yes", "y", *RDZV_FALSE_WORDS)
RDZV_KEYS = (*RDZV_INT_KEYS, "is_host", "store_type")


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``"a=1,b=2"`` -> {"a": "1", "b": "2"}; a key without a value is refused, as torch does."""
    conf: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf {text!r}: expected KEY=VALUE[,KEY=VALUE...]")
        conf[key.strip()] = value.strip()
    return conf


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback, its hostname or one of its addresses)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return bool(wanted & mine) or any(ipaddress.ip_address(a).is_loopback for a in wanted)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``port`` (the c10d store listens on all interfaces)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


@dataclass
class AgentSettings:
    """What one ``torchrun`` agent is started with (one per node)."""

    nnodes: str = "1:3"
    nproc_per_node: int = 1
    rdzv_endpoint: str = "127.0.0.1:29400"
    rdzv_id: str = "ddpguide"
    max_restarts: int = 3
    monitor_interval: float = TUNED_MONITOR_INTERVAL
    rdzv_conf: dict[str, str] = field(
        default_factory=lambda: {k: str(v) for k, v in TUNED_RDZV_CONF.items()})
    local_addr: str | None = None
    share_store: bool = False  # True reproduces torchrun's default (and its scale-up hang)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentSettings:
        """From parsed ``node`` arguments: tuned, or torchrun's with ``--torchrun-defaults``."""
        if args.torchrun_defaults:
            conf = {k: str(v) for k, v in TORCHRUN_RDZV_CONF.items()}
            monitor = TORCHRUN_MONITOR_INTERVAL
        else:
            conf = {k: str(v) for k, v in TUNED_RDZV_CONF.items()}
            monitor = TUNED_MONITOR_INTERVAL
        given = parse_rdzv_conf(args.rdzv_conf)
        conf.update(given)
        if args.external_store:
            if given.get("is_host", "false").lower() not in RDZV_FALSE_WORDS:
                raise UsageError(f"--rdzv-conf is_host={given['is_host']}: contradicts "
                                 "--external-store (the store runs elsewhere)")
            conf["is_host"] = "false"
        return cls(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                   rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                   max_restarts=args.max_restarts,
                   monitor_interval=monitor if args.monitor_interval is None
                   else args.monitor_interval,
                   rdzv_conf=conf, local_addr=args.local_addr, share_store=args.share_store)

    def validate(self) -> AgentSettings:
        """Raise :class:`UsageError` with one sentence for the first bad value."""
        parse_nnodes(self.nnodes)
        parse_endpoint(self.rdzv_endpoint)
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: must be >= 0")
        if not (math.isfinite(self.monitor_interval) and self.monitor_interval > 0):
            raise UsageError(f"--monitor-interval {self.monitor_interval:g}: must be a number "
                             "of seconds above 0")
        if not self.rdzv_id or any(c.isspace() for c in self.rdzv_id):
            raise UsageError(f"--rdzv-id {self.rdzv_id!r}: must be a non-empty word")
        for key, value in self.rdzv_conf.items():
            if key not in RDZV_KEYS:
                raise UsageError(f"--rdzv-conf {key}={value}: unknown key (the c10d rendezvous "
                                 f"reads {', '.join(RDZV_KEYS)})")
            if key in RDZV_INT_KEYS and (not value.isdigit() or int(value) < 1):
                raise UsageError(f"--rdzv-conf {key}={value}: must be a whole number >= 1 "
                                 "(torchrun reads these as integers)")
            if key == "is_host" and value.lower() not in RDZV_BOOL_WORDS:
                raise UsageError(f"--rdzv-conf is_host={value}: must be true or false")
            if key == "store_type" and value.lower() != "tcp":
                raise UsageError(f"--rdzv-conf store_type={value}: node mode needs the TCP "
                                 "store (store_type=tcp) at --rdzv-endpoint")
        return self

    @property
    def may_host_store(self) -> bool:
        """False when ``is_host`` says another process hosts the rendezvous store."""
        return self.rdzv_conf.get("is_host", "").lower() not in RDZV_FALSE_WORDS

    def torchrun_args(self) -> list[str]:
        """The launcher half of the torchrun command line (the worker half follows)."""
        conf = ",".join(f"{k}={v}" for k, v in self.rdzv_conf.items())
        args = [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval:g}",
        ]
        if conf:
            args.append(f"--rdzv-conf={conf}")
        if self.local_addr:
            args.append(f"--local-addr={self.local_addr}")
        return args

    def environment(self) -> dict[str, str]:
        """Environment variables the agent needs besides the inherited ones."""
        return {} if self.share_store else dict(STORE_SHARING_WORKAROUND)
