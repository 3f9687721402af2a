"""The knobs of an elastic run and their checks: what ``node`` mode passes to torchrun.

Nothing here imports torch, so ``--help`` and bad-input errors are instant.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

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


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


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
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    if not 1 <= int(port) <= 65535:
        raise UsageError(f"--rdzv-endpoint {text!r}: port {port} is outside 1-65535")
    return host, int(port)


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``"a=1,b=2"`` -> {"a": "1", "b": "2"}."""
    conf: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
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

    def validate(self) -> "AgentSettings":
        """Raise :class:`UsageError` with one sentence for the first bad value."""
        parse_nnodes(self.nnodes)
        parse_endpoint(self.rdzv_endpoint)
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: must be >= 0")
        if self.monitor_interval <= 0:
            raise UsageError(f"--monitor-interval {self.monitor_interval}: must be > 0")
        if not self.rdzv_id or any(c.isspace() for c in self.rdzv_id):
            raise UsageError(f"--rdzv-id {self.rdzv_id!r}: must be a non-empty word")
        for key in ("join_timeout", "last_call_timeout", "keep_alive_interval",
                    "keep_alive_max_attempt", "read_timeout"):
            value = self.rdzv_conf.get(key)
            if value is not None and (not value.isdigit() or int(value) < 1):
                raise UsageError(f"--rdzv-conf {key}={value}: must be a whole number >= 1 "
                                 "(torchrun reads these as integers)")
        return self

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


def command_line(settings: AgentSettings, worker_args: list[str]) -> str:
    """The equivalent plain ``torchrun`` command, for the reader to copy."""
    env = " ".join(f"{k}={v}" for k, v in settings.environment().items())
    parts = [env, "torchrun", *settings.torchrun_args(), "-m", "ddpguide.elastic.worker",
             *worker_args]
    return " ".join(p for p in parts if p)

