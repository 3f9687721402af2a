"""Making and removing a cluster's namespaces, with a record of who owns them.

Order makes a crash at any point recoverable: the record (its driver's pid and
that process's start time) is written before the first namespace and removed
after the last one. A later :func:`remove_dead` removes a cluster only when its
record says the driver is gone (a pid reused by another process does not count
as alive: its start time differs), or when a namespace of the package has no
record at all; a live driver's cluster is never touched.

Every ``ip``/``tc`` call is bounded in time; nothing here names the host's own
interfaces, routes or firewall: links are created inside the switch namespace
and their other ends moved straight into the node namespaces.

Each node also gets a hosts file of its own, ``/etc/netns/<namespace>/hosts``
(iproute2's folder for a namespace's configuration: ``ip netns exec`` mounts it
over ``/etc/hosts`` for the commands it runs, and nobody else reads it), naming
every node of the cluster at its address, so that node names resolve inside
the cluster as host names do on a real one. It is removed with its namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ddpguide.cluster.spec import Node, Spec, bridge_name, names, port_name, rate_text, run_id_of
from ddpguide.core.commands import write_atomically
from ddpguide.core.processes import alive, signal_all

RECORDS = Path("/run/ddpguide-cluster")
#: iproute2's per-namespace configuration: ``ip netns exec NS`` mounts ``ETC_NETNS/NS/*`` over ``/etc``
ETC_NETNS = Path("/etc/netns")
COMMAND_TIMEOUT = 15.0
QUEUE_LATENCY = "50ms"


class MissingPrerequisite(RuntimeError):
    """Root, ``ip`` or ``tc`` is missing: the message says what and how to get it."""


def missing_prerequisite() -> str | None:
    """One line naming what a cluster needs and this machine lacks, or None."""
    if os.geteuid() != 0:
        return ("network namespaces need root: run as root (e.g. sudo -E env PATH=$PATH ...) "
                "or read the saved bench run in book/measurements/cluster.json")
    lacking = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if lacking:
        return (f"{' and '.join(lacking)} not found: install iproute2 "
                "(apt-get install iproute2, or dnf install iproute)")
    if shutil.which("unshare") is None:
        return "unshare not found: install util-linux (apt-get install util-linux)"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command, bounded in time; a failure raises with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def start_time(pid: int) -> str | None:
    """Process ``pid``'s start time in clock ticks since boot (None when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_path(run_id: str) -> Path:
    return RECORDS / f"{run_id}.json"


def write_record(run_id: str, spec: Spec, driver: int, holder: str) -> dict[str, object]:
    switch, nodes = names(run_id, spec)
    record: dict[str, object] = {
        "run_id": run_id, "driver_pid": driver, "driver_start": start_time(driver),
        "holder": holder, "cwd": os.getcwd(), "created": time.time(), "switch": switch,
        "spec": {"nodes": spec.nodes, "ranks_per_node": spec.ranks_per_node, "link": spec.link,
                 "slow_node": spec.slow_node, "slow_link": spec.slow_link},
    }
    RECORDS.mkdir(parents=True, exist_ok=True)
    write_atomically(record_path(run_id), json.dumps(record, indent=1))
    return record


def read_records() -> dict[str, dict[str, object]]:
    """Every cluster record on this machine, by run id (unreadable ones skipped)."""
    out = {}
    for path in sorted(RECORDS.glob("*.json")) if RECORDS.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            out[path.stem] = json.loads(path.read_text())
    return out


def driver_alive(record: dict[str, object]) -> bool:
    pid = record.get("driver_pid")
    return (isinstance(pid, int) and alive(pid)
            and start_time(pid) == record.get("driver_start"))


def package_namespaces() -> dict[str, list[str]]:
    """The package's namespaces that exist now, by run id."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    out: dict[str, list[str]] = {}
    for line in listed:
        name = line.split(" ", 1)[0].strip()
        run_id = run_id_of(name)
        if run_id:
            out.setdefault(run_id, []).append(name)
    return out


def package_configs() -> dict[str, list[Path]]:
    """The package's folders in ``/etc/netns`` that exist now, by run id."""
    out: dict[str, list[Path]] = {}
    for path in sorted(ETC_NETNS.iterdir()) if ETC_NETNS.is_dir() else []:
        run_id = run_id_of(path.name)
        if run_id:
            out.setdefault(run_id, []).append(path)
    return out


def hosts_file(nodes: list[Node]) -> str:
    """A node's ``/etc/hosts``: loopback, and every node of the cluster by name."""
    return "".join(["127.0.0.1\tlocalhost\n::1\tlocalhost\n",
                    *(f"{n.address}\t{n.name}\n" for n in nodes)])


def create(run_id: str, spec: Spec) -> tuple[str, list[Node]]:
    """Make the switch, the nodes, their links and rate limits (the record is written first)."""
    switch, nodes = names(run_id, spec)
    bridge = bridge_name(run_id)
    sh("ip", "netns", "add", switch)
    sh("ip", "-n", switch, "link", "set", "lo", "up")
    sh("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
    sh("ip", "-n", switch, "link", "set", bridge, "up")
    for node in nodes:
        port = port_name(run_id, node.index)
        sh("ip", "netns", "add", node.netns)
        (ETC_NETNS / node.netns).mkdir(parents=True, exist_ok=True)
        write_atomically(ETC_NETNS / node.netns / "hosts", hosts_file(nodes))
        sh("ip", "-n", node.netns, "link", "set", "lo", "up")
        sh("ip", "-n", switch, "link", "add", port, "type", "veth",
           "peer", "name", node.ifname, "netns", node.netns)
        sh("ip", "-n", switch, "link", "set", port, "master", bridge, "up")
        sh("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
        sh("ip", "-n", node.netns, "link", "set", node.ifname, "up")
        for netns, dev in ((node.netns, node.ifname), (switch, port)):
            sh("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", rate_text(node.rate_bits), "burst", f"{burst_bytes(node.rate_bits)}",
               "latency", QUEUE_LATENCY)
    return switch, nodes


def burst_bytes(rate_bits: int) -> int:
    """tbf's bucket: 1 ms at the rate, at least 64 KiB (a TSO packet must fit in it)."""
    return max(64 * 1024, rate_bits // 8 // 1000)


def wait_for_exit(pids: list[int], timeout: float) -> list[int]:
    """Block until every process of ``pids`` has ended or ``timeout`` s have passed (one
    ``select`` on their pidfds, no polling); the pids still running."""
    handles = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            handles[os.pidfd_open(pid)] = pid
    deadline = time.monotonic() + timeout
    try:
        while handles and (left := deadline - time.monotonic()) > 0:
            ended, _, _ = select.select(list(handles), [], [], left)
            for fd in ended:
                os.close(fd)
                del handles[fd]
        return sorted(handles.values())
    finally:
        for fd in handles:
            os.close(fd)


def kill_inside(netns: str, grace: float = 2.0) -> None:
    """Stop every process still running in ``netns``: SIGTERM, up to ``grace`` s for them to
    end, then SIGKILL (twice: a process may have forked meanwhile)."""
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
        out = sh("ip", "netns", "pids", netns, check=False).stdout.split()
        pids = [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]
        if not pids:
            return
        signal_all(pids, sig)
        wait_for_exit(pids, grace)


def destroy(run_id: str, netns_names: list[str] | None = None) -> None:
    """Remove cluster ``run_id``: its processes, namespaces (their links go with them), hosts
    files, record."""
    present = package_namespaces().get(run_id, []) if netns_names is None else netns_names
    for netns in sorted(present, key=lambda n: n.endswith("-sw")):  # nodes first, switch last
        kill_inside(netns)
        sh("ip", "netns", "del", netns, check=False)
    for folder in package_configs().get(run_id, []):
        shutil.rmtree(folder, ignore_errors=True)
    left = package_namespaces().get(run_id, []) + [p.name for p in package_configs().get(run_id, [])]
    if left:
        raise RuntimeError(f"namespaces of cluster {run_id} could not be removed: {', '.join(left)}")
    with contextlib.suppress(FileNotFoundError):
        record_path(run_id).unlink()


def remove_dead() -> list[str]:
    """Remove every cluster whose driver is dead (or that has no record); the run ids removed."""
    # Namespaces first, records second: a namespace seen here was made after its record
    # was written, so a live cluster being made now is never taken for an orphan.
    present, configs = package_namespaces(), package_configs()
    records = read_records()
    removed = []
    for run_id in sorted(set(records) | set(present) | set(configs)):
        record = records.get(run_id)
        if record is not None and driver_alive(record):
            continue
        destroy(run_id, present.get(run_id, []))
        removed.append(run_id)
    return removed
