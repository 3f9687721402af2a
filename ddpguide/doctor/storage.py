"""What breaks long jobs outside the network: the checkpoint directory, /dev/shm, the clocks.

Each rank writes a small file into the checkpoint directory and looks for every
other rank's: a checkpoint that every rank writes and reads back needs one
directory that all of them see (a shared file system across nodes). Free space
is compared with the size of one checkpoint, ``/dev/shm`` with what nccl's
shared-memory transport needs, and each rank's wall clock with rank 0's.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddpguide.doctor.consistency import Problem

#: Below this, nccl's shared-memory transport fails (Docker's default /dev/shm is 64 MiB).
MIN_SHM_BYTES = 512 * 2 ** 20
#: Clocks further apart than this make logs of different hosts disagree.
MAX_CLOCK_SKEW_S = 5.0


def format_size(nbytes: float) -> str:
    """1.5 GiB, 64.0 MiB, 512 B: a size for a message."""
    for unit, factor in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f} {unit}"
    return f"{int(nbytes)} B"


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """The size of ``/dev/shm``, or None where there is none."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_frsize * stats.f_blocks


def _probe(directory: Path, token: str, rank: int) -> Path:
    return directory / f".ddpguide-doctor-{token}-rank{rank}"


def probe_directory(directory: Path, token: str, rank: int, world: int,
                    wait_s: float) -> dict[str, Any]:
    """Write this rank's file, then wait up to ``wait_s`` to see every rank's; remove ours."""
    mine = _probe(directory, token, rank)
    result: dict[str, Any] = {"dir": str(directory), "write_error": None, "seen": [],
                              "free_bytes": None}
    try:
        mine.write_text(f"{rank} {socket.gethostname()}\n")
    except OSError as error:
        result["write_error"] = error.strerror or type(error).__name__
    deadline = time.monotonic() + wait_s
    while True:
        seen = [r for r in range(world) if _probe(directory, token, r).exists()]
        if len(seen) == world or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    result["seen"] = seen
    try:
        result["free_bytes"] = shutil.disk_usage(directory).free
    except OSError:
        pass
    return result


def remove_probe(directory: Path, token: str, rank: int) -> None:
    """Best effort: leave the directory as it was."""
    try:
        _probe(directory, token, rank).unlink()
    except OSError:
        pass


def storage_problems(per_rank: Mapping[int, dict[str, Any] | None], hosts: dict[int, str], world: int,
                     checkpoint_bytes: int | None) -> list[Problem]:
    """Not writable, not the same directory on every rank, too little free space."""
    problems = []
    for rank, found in sorted(per_rank.items()):
        if not found:
            continue
        where = f"checkpoint directory {found['dir']}"
        if found["write_error"]:
            problems.append(Problem(rank, hosts[rank], f"{where} is not writable ({found['write_error']})"))
            continue
        unseen = sorted(set(range(world)) - set(found["seen"]))
        if unseen:
            problems.append(Problem(rank, hosts[rank], f"{where} is not the directory the other ranks "
                                    f"write to: this rank does not see the files of ranks "
                                    f"{', '.join(map(str, unseen))} (a checkpoint needs one "
                                    "directory that every rank sees)"))
        free = found["free_bytes"]
        if checkpoint_bytes and free is not None and free < checkpoint_bytes:
            problems.append(Problem(rank, hosts[rank], f"{where} has {format_size(free)} free, less "
                                    f"than one checkpoint ({format_size(checkpoint_bytes)})"))
    return problems


def shm_problems(records: Sequence[dict[str, Any]]) -> list[Problem]:
    """A small /dev/shm on a rank that runs nccl."""
    return [Problem(r["rank"], r["host"], f"/dev/shm is {format_size(r['shm_bytes'])}, below "
                    f"{format_size(MIN_SHM_BYTES)}: nccl's shared-memory transport fails with it "
                    "(in a container: --ipc=host or --shm-size)")
            for r in records
            if r["backend"] == "nccl" and r.get("shm_bytes") is not None
            and r["shm_bytes"] < MIN_SHM_BYTES]


def clock_problems(skews: dict[int, float], hosts: dict[int, str]) -> list[Problem]:
    """Ranks whose wall clock is more than MAX_CLOCK_SKEW_S from rank 0's."""
    return [Problem(rank, hosts[rank], f"wall clock {skew:+.1f} s from rank 0's (more than "
                    f"{MAX_CLOCK_SKEW_S:g} s: logs of different hosts will not line up; run NTP)")
            for rank, skew in sorted(skews.items()) if abs(skew) > MAX_CLOCK_SKEW_S]
