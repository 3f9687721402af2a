"""SIGKILL a process in the middle of :func:`ddpguide.sharding.dcp.save_sharded`, then load.

A child process saves checkpoint A, then starts saving checkpoint B and stops
at one of :data:`POINTS`, where the parent kills it with SIGKILL (no cleanup
runs, as after ``kill -9`` or a lost machine). The parent then lists what is on
disk and loads whatever :func:`~ddpguide.sharding.dcp.load_sharded` finds into
a fresh model: every point must give A or B complete, never a mixture and
never nothing. Run by the tests and by the chapter.

The child is ``python -m ddpguide.sharding.dcp_kill DIRECTORY POINT``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from ddpguide.core.models import Stack
from ddpguide.launch import ranks
from ddpguide.sharding.dcp import find_checkpoint, load_sharded, save_sharded
from ddpguide.sharding.dcp_workers import full_tensors

POINTS = {
    "writing": "data files written, metadata not yet (inside dcp.save)",
    "old_moved": "after renaming the old checkpoint to .prev, before moving the new one in",
    "new_moved": "after moving the new checkpoint in, before deleting .prev",
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


def _pause(workdir: Path) -> None:
    (workdir / MARKER).write_text(str(os.getpid()))
    time.sleep(120)  # the parent kills us long before; bounded all the same
    os._exit(3)


def _install_pause(point: str, workdir: Path) -> None:
    target = (workdir / CHECKPOINT).absolute()
    if point == "writing":
        finish = dcp.FileSystemWriter.finish

        def paused_finish(self, *args, **kwargs):
            _pause(workdir)
            return finish(self, *args, **kwargs)

        mock.patch.object(dcp.FileSystemWriter, "finish", paused_finish).start()  # for the rest of the process
        return
    rename = os.rename

    def paused_rename(src, dst, *args, **kwargs):
        rename(src, dst, *args, **kwargs)
        moved_old = point == "old_moved" and Path(src).absolute() == target
        moved_new = point == "new_moved" and Path(dst).absolute() == target
        if moved_old or moved_new:
            _pause(workdir)

    os.rename = paused_rename


def child(workdir: Path, point: str) -> None:
    """Save A, then save B with a pause at ``point`` (the parent kills us there)."""
    torch.set_num_threads(1)
    for name, seed in (("A", 0), ("B", 1)):
        model, optimizer = _model(seed)
        torch.save(full_tensors(model, optimizer), workdir / f"{name}.pt")
        if name == "B":
            _install_pause(point, workdir)
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
    entries = sorted(p.name for p in workdir.iterdir() if p.name.startswith((CHECKPOINT, ".")))
    found = find_checkpoint(workdir / CHECKPOINT)
    model, optimizer = _model(99)  # other weights: only the load can make them equal
    extra = load_sharded(model, optimizer, workdir / CHECKPOINT)
    expected = torch.load(workdir / f"{extra['name']}.pt", weights_only=True)
    loaded = full_tensors(model, optimizer)
    exact = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k])
                                                      for k in expected)
    return {"point": point, "signal": killed_by, "entries": entries,
            "loaded_from": found.name if found else None, "loaded": extra["name"], "exact": exact}


def save_again(workdir: str | os.PathLike) -> list[str]:
    """One complete save after a kill; returns the directory entries (leftovers are gone)."""
    workdir = Path(workdir)
    model, optimizer = _model(2)
    save_sharded(model, optimizer, workdir / CHECKPOINT, extra={"name": "C"})
    return sorted(p.name for p in workdir.iterdir() if p.name.startswith((CHECKPOINT, ".")))


if __name__ == "__main__":
    child(Path(sys.argv[1]), sys.argv[2])
