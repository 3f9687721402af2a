"""SIGKILL processes in the middle of :func:`ddpguide.sharding.dcp.save_sharded`, then load.

A child process saves checkpoint A, then starts saving checkpoint B and stops
at one of :data:`POINTS`, where the parent kills it with SIGKILL (no cleanup
runs, as after ``kill -9`` or a lost machine). The parent then lists what is on
disk and loads whatever :func:`~ddpguide.sharding.dcp.load_sharded` finds into
a fresh model: every point must give A or B complete, never a mixture and
never nothing. Run by the tests and by the chapter.

:func:`kill_ranks_during_save` does the same to a save by 2 ranks (FSDP2 shards on
a gloo group, each rank writing its own file): at each of :data:`RANK_POINTS` one
rank or every rank stops halfway through writing its file and is killed. A rank
that survives its peer's death must fail on its own and leave checkpoint A in
place: the new one is never swapped in unless every rank finished it.

The child is ``python -m ddpguide.sharding.dcp_kill DIRECTORY POINT`` (with a
launcher's variables for the 2-rank points).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpguide.core.models import Stack
from ddpguide.core.processes import store_port
from ddpguide.core.runtime import launcher_environment
from ddpguide.launch import ranks
from ddpguide.sharding.dcp import find_checkpoint, load_sharded, save_sharded
from ddpguide.sharding.dcp_workers import full_tensors

POINTS = {
    "old_moved": "after renaming the old checkpoint to .prev, before moving the new one in",
    "new_moved": "after moving the new checkpoint in, before deleting .prev",
}
#: the 2-rank points: which ranks stop after writing the first item of their file (and are killed)
RANK_POINTS = {
    "one_rank_mid_write": "rank 1 halfway through writing its file; rank 0 goes on to the gather",
    "every_rank_mid_write": "both ranks halfway through writing their files",
}
CHECKPOINT = "checkpoint"
MARKER = "paused"


def _model(seed: int):
    """A small model after one Adam step (so that the optimizer has state to save)."""
    torch.manual_seed(seed)
    model = Stack(8, 16)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 8)).backward()
    optimizer.step()
    return model, optimizer


def _pause(workdir: Path, marker: str = MARKER) -> None:
    (workdir / marker).write_text(str(os.getpid()))
    time.sleep(120)  # the parent kills us long before; bounded all the same
    os._exit(3)


def _install_pause(point: str, workdir: Path) -> None:
    target = (workdir / CHECKPOINT).absolute()
    rename = os.rename

    def paused_rename(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        moved_old = point == "old_moved" and Path(src).absolute() == target
        moved_new = point == "new_moved" and Path(dst).absolute() == target
        if moved_old or moved_new:
            _pause(workdir)

    os.rename = paused_rename


def _pause_mid_write(workdir: Path, rank: int) -> None:
    """Stop this rank after the first item of its data file is on disk (the file half written)."""
    from torch.distributed.checkpoint import filesystem

    write_item = filesystem._write_item

    def paused_write_item(transforms, stream, *args, **kwargs):
        write_item(transforms, stream, *args, **kwargs)
        stream.flush()
        _pause(workdir, f"{MARKER}.{rank}")

    mock.patch.object(filesystem, "_write_item", paused_write_item).start()


def _sharded_model(seed: int):
    """:func:`_model`'s model and optimizer, the model's layers and root sharded with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _ = _model(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.mse_loss(model(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))),
               torch.zeros(4, 8)).backward()
    optimizer.step()
    return model, optimizer


def child(workdir: Path, point: str) -> None:
    """Save A, then save B with a pause at ``point`` (the parent kills us there)."""
    torch.set_num_threads(1)
    ranked = point in RANK_POINTS
    if ranked:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank() if ranked else 0
    for name, seed in (("A", 0), ("B", 1)):
        model, optimizer = _sharded_model(seed) if ranked else _model(seed)
        tensors = full_tensors(model, optimizer)  # a collective with shards: every rank calls it
        if rank == 0:
            torch.save(tensors, workdir / f"{name}.pt")
        if name == "B" and not ranked:
            _install_pause(point, workdir)
        elif name == "B" and (rank == 1 or point == "every_rank_mid_write"):
            _pause_mid_write(workdir, rank)
        save_sharded(model, optimizer, workdir / CHECKPOINT, extra={"name": name})


def kill_during_save(point: str, workdir: str | os.PathLike, timeout: float = 120.0) -> dict:
    """Kill a save at ``point`` (one of :data:`POINTS`); report what is left and what loads.

    Returns the directory entries after the kill, which copy
    :func:`find_checkpoint` picked, which checkpoint (``A`` or ``B``) loaded,
    and whether every model and optimizer tensor equals that checkpoint's.
    """
    if point not in POINTS:
        raise ValueError(f"unknown point {point!r}: choose one of {', '.join(POINTS)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    with ranks.Ranks() as group:
        saver = group.start(ranks.Command([sys.executable, "-m", __name__, str(workdir), point]))
        group.wait(timeout, until=(workdir / MARKER).exists)
        if not (workdir / MARKER).exists():
            code = group.returncode(saver)
            group.stop(grace=0.0)
            if code is None:
                raise TimeoutError(f"the saving process did not reach its pause within {timeout:g} s")
            raise RuntimeError(f"the saving process exited with {code} before "
                               f"pausing:\n{group.ended().output}")
        group.signal(saver, signal.SIGKILL)
        group.stop(grace=0.0)
        killed_by = group.returncode(saver)
    return {"point": point, "signal": killed_by, **_what_loads(workdir)}


def kill_ranks_during_save(point: str, workdir: str | os.PathLike, timeout: float = 120.0) -> dict:
    """Kill ranks of a 2-rank save at ``point`` (one of :data:`RANK_POINTS`); report as
    :func:`kill_during_save` does, with each rank's exit status and what it printed."""
    if point not in RANK_POINTS:
        raise ValueError(f"unknown point {point!r}: choose one of {', '.join(RANK_POINTS)}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    killed = [1] if point == "one_rank_mid_write" else [0, 1]
    markers = [workdir / f"{MARKER}.{rank}" for rank in killed]
    port = store_port()
    with ranks.Ranks() as group:
        for rank in (0, 1):
            group.start(ranks.Command([sys.executable, "-m", __name__, str(workdir), point],
                                      env={**launcher_environment(rank, 2, port, addr="127.0.0.1"),
                                           "OMP_NUM_THREADS": "1"}))
        group.wait(timeout, until=lambda: all(m.exists() for m in markers))
        if not all(m.exists() for m in markers):
            group.stop(grace=0.0)
            raise RuntimeError(f"the saving ranks did not reach their pause within {timeout:g} s:\n"
                               f"{group.ended().output}")
        for rank in killed:
            group.signal(rank, signal.SIGKILL)
        group.wait(timeout, all_end=True)  # a surviving rank must notice and end on its own
        timed_out = any(group.alive(rank) for rank in (0, 1))
        group.stop(grace=0.0)
        ended = group.ended(timed_out)
    report = _what_loads(workdir)
    return report | {"point": point, "returncodes": ended.returncodes, "timed_out": timed_out,
                     "output": ended.output}


def _what_loads(workdir: Path) -> dict:
    """The directory entries, the copy :func:`find_checkpoint` picks, and what loads from it."""
    entries = sorted(p.name for p in workdir.iterdir() if p.name.startswith((CHECKPOINT, ".")))
    found = find_checkpoint(workdir / CHECKPOINT)
    model, optimizer = _model(99)  # other weights: only the load can make them equal
    extra = load_sharded(model, optimizer, workdir / CHECKPOINT)
    expected = torch.load(workdir / f"{extra['name']}.pt", weights_only=True)
    loaded = full_tensors(model, optimizer)
    exact = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k])
                                                      for k in expected)
    return {"entries": entries, "loaded_from": found.name if found else None, "loaded": extra["name"],
            "exact": exact}


def save_again(workdir: str | os.PathLike) -> list[str]:
    """One complete save after a kill; returns the directory entries (leftovers are gone)."""
    workdir = Path(workdir)
    model, optimizer = _model(2)
    save_sharded(model, optimizer, workdir / CHECKPOINT, extra={"name": "C"})
    return sorted(p.name for p in workdir.iterdir() if p.name.startswith((CHECKPOINT, ".")))


if __name__ == "__main__":
    child(Path(sys.argv[1]), sys.argv[2])
